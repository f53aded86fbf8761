package report

import (
	"fmt"
	"math"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/chart"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// AttainmentChart is kvbench goodput's chart: the share of requests within
// the SLO against the arrival rate, one line per policy, the target as a
// dashed line; each policy's goodput is where its line leaves the target.
type AttainmentChart struct {
	SLO      string // e.g. "TTFT ≤ 500ms and TPOT ≤ 25ms"
	Subtitle string
	Target   float64 // 0..1
	Series   []AttainmentSeries
}

// AttainmentSeries is one policy's measured rates, in increasing order.
type AttainmentSeries struct {
	Policy     string
	Goodput    float64
	Rates      []float64 // requests/s
	Attainment []float64 // 0..1
}

// AttainmentFigure lays the chart out.
func AttainmentFigure(c AttainmentChart) (*chart.Figure, error) {
	fig := &chart.Figure{
		Title:    "Requests within the SLO (" + c.SLO + ") against arrival rate, by routing policy",
		Subtitle: c.Subtitle,
		Width:    1100, Height: 640,
	}
	pan := chart.NewPanel("", "arrival rate (requests/s)", "requests within the SLO (%)")
	p := pan.Plot
	p.Add(plotter.NewGrid())
	p.X.Tick.Marker = chart.LinearTicks{N: 10}
	p.Y.Tick.Marker = chart.LinearTicks{N: 10}
	p.Y.Min, p.Y.Max = 0, 100
	hi := 0.0
	for i, s := range c.Series {
		if len(s.Rates) == 0 {
			continue
		}
		xys := make(plotter.XYs, len(s.Rates))
		for k := range s.Rates {
			xys[k] = plotter.XY{X: s.Rates[k], Y: 100 * s.Attainment[k]}
			hi = math.Max(hi, s.Rates[k])
		}
		line, points, err := plotter.NewLinePoints(xys)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", s.Policy, err)
		}
		line.Color, line.Width = chart.Color(i), chart.Px(2.5)
		points.Color, points.Shape, points.Radius = chart.Color(i), draw.CircleGlyph{}, chart.Px(4)
		label := s.Policy
		if s.Goodput > 0 {
			label = fmt.Sprintf("%s (goodput %.3g/s)", s.Policy, s.Goodput)
		}
		pan.Add(chart.Series{Label: label, Plotters: []plot.Plotter{line, points}})
	}
	if hi > 0 {
		p.X.Min, p.X.Max = 0, hi*1.05
		target, err := plotter.NewLine(plotter.XYs{{X: 0, Y: 100 * c.Target}, {X: hi * 1.05, Y: 100 * c.Target}})
		if err != nil {
			return nil, err
		}
		target.Color, target.Width, target.Dashes = chart.Color(7), chart.Px(1.5), []vg.Length{chart.Px(6), chart.Px(4)}
		pan.Add(chart.Series{Label: fmt.Sprintf("target %.0f %%", 100*c.Target), Plotters: []plot.Plotter{target}})
	}
	fig.Panels = []*chart.Panel{pan}
	return fig, nil
}

// PlotAttainment writes the chart as a PNG to path.
func PlotAttainment(path string, c AttainmentChart) error {
	fig, err := AttainmentFigure(c)
	if err != nil {
		return err
	}
	return fig.Save(path)
}
