// Package stats is kvbench's one quantile type: latency percentiles as the
// JSON reports publish them. Nothing here modifies its input: callers keep
// their samples in arrival order (ingest reads its samples again after the
// percentiles; a sort in place once made its "max" the last sample sorted
// by accident).
package stats

import (
	"encoding/json"
	"slices"
)

// Quantiles are latency percentiles in milliseconds. Mean is valid in the
// reports that publish a mean (kvbench disagg's) and absent from the JSON
// of those whose contract has p50 and p99 only. Quantiles are comparable
// with ==, so determinism tests can compare whole results.
type Quantiles struct {
	P50  float64  `json:"p50"`
	P90  Optional `json:"p90,omitzero"` // published by the reports that judge an SLO
	P99  float64  `json:"p99"`
	Mean Optional `json:"mean,omitzero"`
}

// Optional is a figure a report publishes only when it was computed; a
// computed zero is published.
type Optional struct {
	Value float64
	Valid bool
}

// IsZero makes an invalid Optional absent under omitzero.
func (o Optional) IsZero() bool { return !o.Valid }

// MarshalJSON writes the value as a plain number.
func (o Optional) MarshalJSON() ([]byte, error) { return json.Marshal(o.Value) }

// UnmarshalJSON reads a plain number as a valid value.
func (o *Optional) UnmarshalJSON(b []byte) error {
	if err := json.Unmarshal(b, &o.Value); err != nil {
		return err
	}
	o.Valid = true
	return nil
}

// Of is xs's p50 and p99; zero for no data.
func Of(xs []float64) Quantiles {
	s := sorted(xs)
	return Quantiles{P50: percentile(s, 50), P99: percentile(s, 99)}
}

// WithP90 is Of plus the 90th percentile (zero for no data).
func WithP90(xs []float64) Quantiles {
	s := sorted(xs)
	return Quantiles{P50: percentile(s, 50), P90: Optional{Value: percentile(s, 90), Valid: true}, P99: percentile(s, 99)}
}

// WithMean is Of plus the mean (zero for no data).
func WithMean(xs []float64) Quantiles {
	q := Of(xs)
	q.Mean = Optional{Value: Mean(xs), Valid: true}
	return q
}

// Mean is the arithmetic mean of xs; 0 for no data.
func Mean(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	sum := 0.0
	for _, x := range xs {
		sum += x
	}
	return sum / float64(len(xs))
}

// Percentile is the p-th percentile of xs by linear interpolation between
// closest ranks (NumPy's default); 0 for no data.
func Percentile(xs []float64, p float64) float64 {
	return percentile(sorted(xs), p)
}

// sorted is a sorted copy of xs.
func sorted(xs []float64) []float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s
}

// percentile is Percentile of an already sorted slice.
func percentile(s []float64, p float64) float64 {
	if len(s) == 0 {
		return 0
	}
	pos := p / 100 * float64(len(s)-1)
	lo := int(pos)
	if lo >= len(s)-1 {
		return s[len(s)-1]
	}
	frac := pos - float64(lo)
	return s[lo] + frac*(s[lo+1]-s[lo])
}
