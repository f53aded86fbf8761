// Package goodput finds the highest arrival rate a fleet serves within a
// latency SLO: the rate at which the share of requests meeting the SLO (the
// attainment) still reaches a target. The search is a bracket by doubling or
// halving, then bisection; it knows nothing of simulators, so it is tested
// against attainment curves written down in the tests.
package goodput

import (
	"errors"
	"fmt"
	"math"
)

// Point is one evaluated rate.
type Point[T any] struct {
	Rate       float64 // requests per second
	Attainment float64 // share of all requests within the SLO
	Figures    T       // whatever the evaluation measured there
}

// Search says how to look for the goodput.
type Search struct {
	Target    float64 // attainment to reach, in (0, 1]
	Start     float64 // first rate tried
	MinRate   float64 // below this the goodput is 0
	MaxRate   float64 // the search stops doubling here
	Precision float64 // relative width of the final bracket (0.02: within 2 %)
}

// Result is a search's outcome.
type Result[T any] struct {
	// Goodput is the highest rate found meeting the target (0: none at or
	// above MinRate); At is its point (zero when Goodput is 0).
	Goodput float64
	At      Point[T]
	// Capped: the target was still met at MaxRate, so the goodput is at
	// least that much and the search did not find the knee.
	Capped bool
	// Points are every evaluation in the order made (for a chart).
	Points []Point[T]
}

// ErrSearch marks impossible search settings.
var ErrSearch = errors.New("invalid goodput search")

// Check refuses settings the search cannot work with.
func (s Search) Check() error {
	switch {
	case !(s.Target > 0 && s.Target <= 1):
		return fmt.Errorf("attainment target %v: want (0, 1]: %w", s.Target, ErrSearch)
	case !(s.MinRate > 0) || !(s.Start >= s.MinRate) || !(s.MaxRate >= s.Start) || math.IsInf(s.MaxRate, 0):
		return fmt.Errorf("rates: need 0 < min %v <= start %v <= max %v < inf: %w", s.MinRate, s.Start, s.MaxRate, ErrSearch)
	case !(s.Precision > 0 && s.Precision < 1):
		return fmt.Errorf("precision %v: want (0, 1): %w", s.Precision, ErrSearch)
	}
	return nil
}

// Run searches with eval, which measures one rate. It assumes attainment
// falls as the rate rises; where noise breaks that, it keeps the highest
// rate it saw meet the target below the lowest it saw miss, so the answer
// is always a rate that was measured to meet the target.
func Run[T any](s Search, eval func(rate float64) (Point[T], error)) (Result[T], error) {
	var res Result[T]
	if err := s.Check(); err != nil {
		return res, err
	}
	measure := func(r float64) (Point[T], bool, error) {
		p, err := eval(r)
		if err != nil {
			return p, false, fmt.Errorf("rate %.4g/s: %w", r, err)
		}
		p.Rate = r
		res.Points = append(res.Points, p)
		return p, p.Attainment >= s.Target, nil
	}
	var lo, hi Point[T]
	haveLo := false
	p, ok, err := measure(s.Start)
	if err != nil {
		return res, err
	}
	if ok {
		lo, haveLo = p, true
		for {
			r := lo.Rate * 2
			if r > s.MaxRate {
				if lo.Rate < s.MaxRate {
					r = s.MaxRate
				} else {
					res.Goodput, res.At, res.Capped = lo.Rate, lo, true
					return res, nil
				}
			}
			p, ok, err := measure(r)
			if err != nil {
				return res, err
			}
			if !ok {
				hi = p
				break
			}
			lo = p
		}
	} else {
		hi = p
		for {
			r := hi.Rate / 2
			if r < s.MinRate {
				return res, nil // not even the lowest rate meets the SLO
			}
			p, ok, err := measure(r)
			if err != nil {
				return res, err
			}
			if ok {
				lo, haveLo = p, true
				break
			}
			hi = p
		}
	}
	for haveLo && hi.Rate > lo.Rate*(1+s.Precision) {
		p, ok, err := measure((lo.Rate + hi.Rate) / 2)
		if err != nil {
			return res, err
		}
		if ok {
			lo = p
		} else {
			hi = p
		}
	}
	res.Goodput, res.At = lo.Rate, lo
	return res, nil
}
