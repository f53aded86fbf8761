package report

import (
	"fmt"
	"math"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/chart"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/text"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// The sim chart's size in pixels.
const (
	plotWidth  = 1500
	plotHeight = 680
)

// figurePanel is one panel of the sim chart: a figure per policy.
type figurePanel struct {
	title, yLabel string
	percent       bool // 0–100 axis
	get           func(Result) float64
}

var simPanels = []figurePanel{
	{"Request hit rate", "requests that hit the cache (%)", true, func(r Result) float64 { return 100 * r.RequestHitRate }},
	{"TTFT p50", "time to first token, p50 (ms)", false, func(r Result) float64 { return r.TTFT.P50 }},
	{"TTFT p99", "time to first token, p99 (ms)", false, func(r Result) float64 { return r.TTFT.P99 }},
}

// Figure builds the sim chart: three panels (request hit rate, TTFT p50,
// TTFT p99), one bar per policy in each, labelled with its value; the
// legend names the policies. subtitle describes the run (the console
// table's header).
func Figure(subtitle string, results []Result) (*chart.Figure, error) {
	fig := &chart.Figure{
		Title:    "Request hit rate and time to first token by routing policy",
		Subtitle: subtitle,
		Width:    plotWidth, Height: plotHeight,
	}
	names := make([]string, len(results))
	for i, r := range results {
		names[i] = r.Policy
	}
	// Bars fill 60% of their slot, at most 56 px wide: the panels share
	// what the legend column and the margins leave.
	panelPx := float64(plotWidth-260) / float64(len(simPanels))
	barW := chart.Px(math.Min(56, 0.6*(panelPx-80)/float64(max(len(results), 1))))
	for _, sp := range simPanels {
		pan := chart.NewPanel(sp.title, "routing policy", sp.yLabel)
		p := pan.Plot
		grid := plotter.NewGrid()
		grid.Vertical.Color = nil // horizontal lines only, drawn under the bars
		p.Add(grid)
		hi := 0.0
		for i, r := range results {
			v := finite(sp.get(r))
			hi = math.Max(hi, v)
			bar, err := plotter.NewBarChart(plotter.Values{v}, barW)
			if err != nil {
				return nil, fmt.Errorf("%s bar of %s: %w", sp.title, r.Policy, err)
			}
			bar.XMin = float64(i)
			bar.Color = chart.Color(i)
			bar.LineStyle.Width = 0
			label, err := valueLabel(float64(i), v)
			if err != nil {
				return nil, err
			}
			pan.Add(chart.Series{Label: r.Policy, Plotters: []plot.Plotter{bar, label}})
		}
		p.NominalX(names...)
		p.X.Min, p.X.Max = -0.6, float64(len(results))-0.4
		p.X.Tick.Label.Rotation = math.Pi / 6
		p.X.Tick.Label.XAlign, p.X.Tick.Label.YAlign = draw.XRight, draw.YCenter
		p.Y.Min = 0
		p.Y.Tick.Marker = chart.LinearTicks{N: 5}
		if sp.percent {
			p.Y.Max = 100
		} else {
			p.Y.Max = math.Max(hi, 1)
		}
		p.Y.Max *= 1.1 // room for the value labels above the bars
		fig.Panels = append(fig.Panels, pan)
	}
	return fig, nil
}

// Plot writes the sim chart (Figure) as a PNG to path.
func Plot(path, subtitle string, results []Result) error {
	fig, err := Figure(subtitle, results)
	if err != nil {
		return err
	}
	return fig.Save(path)
}

// valueLabel writes v just above the top of bar x.
func valueLabel(x, v float64) (*plotter.Labels, error) {
	l, err := plotter.NewLabels(plotter.XYLabels{XYs: plotter.XYs{{X: x, Y: v}}, Labels: []string{barLabel(v)}})
	if err != nil {
		return nil, fmt.Errorf("bar label: %w", err)
	}
	st := chart.TextStyle(9, false)
	st.XAlign, st.YAlign = draw.XCenter, draw.YBottom
	l.TextStyle = []text.Style{st}
	l.Offset = vg.Point{Y: chart.Px(3)}
	return l, nil
}

func barLabel(v float64) string {
	if v >= 100 {
		return fmt.Sprintf("%.0f", v)
	}
	return fmt.Sprintf("%.1f", v)
}

// finite maps NaN and ±Inf (no completed request) to 0: a missing bar.
func finite(v float64) float64 {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return 0
	}
	return v
}
