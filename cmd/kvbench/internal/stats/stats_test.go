package stats

import (
	"encoding/json"
	"math"
	"slices"
	"testing"
)

func TestStatsQuantilesLeaveInputAlone(t *testing.T) {
	cases := []struct {
		name     string
		xs       []float64
		p50, p99 float64
		mean     float64
	}{
		{"empty", nil, 0, 0, 0},
		{"one", []float64{7}, 7, 7, 7},
		{"unsorted", []float64{30, 10, 20}, 20, 29.8, 20},
		{"descending", []float64{4, 3, 2, 1}, 2.5, 3.97, 2.5},
		{"duplicates", []float64{5, 1, 5, 1, 5}, 5, 5, 3.4},
		{"hundred, reversed", func() []float64 {
			xs := make([]float64, 100)
			for i := range xs {
				xs[i] = float64(100 - i)
			}
			return xs
		}(), 50.5, 99.01, 50.5},
	}
	near := func(a, b float64) bool { return math.Abs(a-b) < 1e-9 }
	for _, c := range cases {
		before := slices.Clone(c.xs)
		q := WithMean(c.xs)
		if !near(q.P50, c.p50) || !near(q.P99, c.p99) || !q.Mean.Valid || !near(q.Mean.Value, c.mean) {
			t.Errorf("%s: got %+v (mean %v), want p50 %v p99 %v mean %v", c.name, q, q.Mean, c.p50, c.p99, c.mean)
		}
		if p := Percentile(c.xs, 50); !near(p, c.p50) {
			t.Errorf("%s: Percentile 50 = %v, want %v", c.name, p, c.p50)
		}
		if o := Of(c.xs); o.Mean.Valid || o.P50 != q.P50 || o.P99 != q.P99 {
			t.Errorf("%s: Of %+v", c.name, o)
		}
		if !slices.Equal(c.xs, before) {
			t.Errorf("%s: input changed: %v, was %v", c.name, c.xs, before)
		}
	}
}

// The JSON shapes the reports publish: p50/p99 only, or with the mean
// (zero included) when it was computed.
func TestStatsQuantilesJSON(t *testing.T) {
	for _, c := range []struct {
		q    Quantiles
		want string
	}{
		{Of([]float64{1, 3}), `{"p50":2,"p99":2.98}`},
		{WithMean(nil), `{"p50":0,"p99":0,"mean":0}`},
		{WithMean([]float64{1, 3}), `{"p50":2,"p99":2.98,"mean":2}`},
	} {
		b, err := json.Marshal(c.q)
		if err != nil {
			t.Fatal(err)
		}
		if string(b) != c.want {
			t.Errorf("got %s, want %s", b, c.want)
		}
		var back Quantiles
		if err := json.Unmarshal(b, &back); err != nil || back != c.q {
			t.Errorf("%s read back as %+v (%v)", b, back, err)
		}
	}
}
