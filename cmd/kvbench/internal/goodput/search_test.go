package goodput

import (
	"errors"
	"testing"
)

// curve is an attainment curve: 1 up to knee, then falling linearly to 0
// at twice the knee (every rate's attainment is exact, no noise).
func curve(knee float64) func(r float64) (Point[int], error) {
	return func(r float64) (Point[int], error) {
		a := 1.0
		if r > knee {
			a = max(0, 1-(r-knee)/knee)
		}
		return Point[int]{Attainment: a}, nil
	}
}

func TestGoodputSearch(t *testing.T) {
	s := Search{Target: 0.9, Start: 1, MinRate: 0.01, MaxRate: 1000, Precision: 0.02}
	for _, tc := range []struct {
		name   string
		knee   float64
		want   float64 // the true goodput: knee × 1.1 for target 0.9
		capped bool
	}{
		{"above the start", 7, 7.7, false},
		{"below the start", 0.3, 0.33, false},
		{"at the start", 1 / 1.1, 1, false},
		{"beyond the cap", 5000, 1000, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res, err := Run(s, curve(tc.knee))
			if err != nil {
				t.Fatal(err)
			}
			if res.Capped != tc.capped {
				t.Fatalf("capped %v", res.Capped)
			}
			if res.Goodput > tc.want*1.0000001 || res.Goodput < tc.want/(1+s.Precision) {
				t.Fatalf("goodput %.4f, want within 2 %% below %.4f", res.Goodput, tc.want)
			}
			if res.At.Rate != res.Goodput || res.At.Attainment < s.Target {
				t.Fatalf("figures at %+v for goodput %v", res.At, res.Goodput)
			}
			if len(res.Points) > 30 {
				t.Fatalf("%d evaluations", len(res.Points))
			}
		})
	}
}

// Nothing meets the SLO: goodput 0, no figures, no endless halving.
func TestGoodputSearchNoRateMeets(t *testing.T) {
	never := func(r float64) (Point[int], error) { return Point[int]{Attainment: 0.5}, nil }
	res, err := Run(Search{Target: 0.9, Start: 1, MinRate: 0.01, MaxRate: 10, Precision: 0.02}, never)
	if err != nil || res.Goodput != 0 || len(res.Points) != 7 {
		t.Fatalf("goodput %v after %d points, err %v", res.Goodput, len(res.Points), err)
	}
}

// Noise: a dip below the target under the knee stops the bracket there; the
// answer is still a rate measured to meet the target.
func TestGoodputSearchNoisy(t *testing.T) {
	noisy := func(r float64) (Point[int], error) {
		a := 1.0
		if r > 3.9 && r < 4.1 || r > 10 {
			a = 0.5
		}
		return Point[int]{Attainment: a, Figures: int(r * 100)}, nil
	}
	res, err := Run(Search{Target: 0.9, Start: 1, MinRate: 0.01, MaxRate: 100, Precision: 0.02}, noisy)
	if err != nil {
		t.Fatal(err)
	}
	if res.Goodput < 2 || res.Goodput >= 4 || res.At.Attainment < 0.9 || res.At.Figures != int(res.Goodput*100) {
		t.Fatalf("goodput %v at %+v", res.Goodput, res.At)
	}
}

func TestGoodputSearchErrors(t *testing.T) {
	for _, s := range []Search{
		{Target: 0, Start: 1, MinRate: 0.1, MaxRate: 10, Precision: 0.02},
		{Target: 0.9, Start: 0.01, MinRate: 0.1, MaxRate: 10, Precision: 0.02},
		{Target: 0.9, Start: 1, MinRate: 0.1, MaxRate: 0.5, Precision: 0.02},
		{Target: 0.9, Start: 1, MinRate: 0.1, MaxRate: 10, Precision: 0},
	} {
		if _, err := Run(s, curve(1)); !errors.Is(err, ErrSearch) {
			t.Errorf("%+v: err %v", s, err)
		}
	}
	boom := errors.New("boom")
	_, err := Run(Search{Target: 0.9, Start: 1, MinRate: 0.1, MaxRate: 10, Precision: 0.02},
		func(float64) (Point[int], error) { return Point[int]{}, boom })
	if !errors.Is(err, boom) {
		t.Fatalf("eval error lost: %v", err)
	}
}
