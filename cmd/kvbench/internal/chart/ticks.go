package chart

import (
	"math"
	"strconv"

	"gonum.org/v1/plot"
)

// LinearTicks labels about N ticks at steps of 1, 2 or 5 × 10^k, with an
// unlabelled tick between each pair. gonum's DefaultTicks aims at three
// labels, too few to read a bar's height off a tall panel.
type LinearTicks struct{ N int }

var _ plot.Ticker = LinearTicks{}

// Ticks implements plot.Ticker.
func (t LinearTicks) Ticks(lo, hi float64) []plot.Tick {
	if !(hi > lo) || math.IsInf(hi-lo, 0) {
		return []plot.Tick{{Value: lo, Label: strconv.FormatFloat(lo, 'g', 4, 64)}}
	}
	step := niceStep((hi - lo) / float64(max(t.N, 1)))
	prec := max(0, -int(math.Floor(math.Log10(step))))
	var ticks []plot.Tick
	for k := math.Ceil(lo / step * 2); k/2*step <= hi*(1+1e-9); k++ {
		v := k / 2 * step
		if math.Mod(k, 2) != 0 {
			ticks = append(ticks, plot.Tick{Value: v})
			continue
		}
		ticks = append(ticks, plot.Tick{Value: v, Label: strconv.FormatFloat(v, 'f', prec, 64)})
	}
	return ticks
}

// niceStep is the step of 1, 2 or 5 × 10^k nearest x (on a log scale).
func niceStep(x float64) float64 {
	p := math.Pow(10, math.Floor(math.Log10(x)))
	for _, m := range []float64{1, 2, 5} {
		next := map[float64]float64{1: 2, 2: 5, 5: 10}[m]
		if x < math.Sqrt(m*next)*p {
			return m * p
		}
	}
	return 10 * p
}
