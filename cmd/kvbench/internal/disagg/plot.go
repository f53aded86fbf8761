package disagg

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/chart"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// The chart's size in pixels: a panel per prompt length, a legend column.
const (
	panelWidth = 330
	plotHeight = 620
)

// modeStyle draws each mode alike in every chart: off and always thick
// lines with filled markers, auto a thin line with rings drawn on top, so
// it shows where auto coincides with another mode.
var modeStyle = map[string]struct {
	color  int // chart.Color index
	width  float64
	glyph  draw.GlyphDrawer
	radius float64
}{
	"off":    {0, 3, draw.BoxGlyph{}, 4.5},
	"always": {1, 3, draw.CircleGlyph{}, 4.5},
	"auto":   {2, 1.5, ring{width: chart.Px(2)}, 8},
}

// ring is gonum's RingGlyph with a line wide enough to see (gonum's is
// half a point).
type ring struct{ width vg.Length }

func (g ring) DrawGlyph(c *draw.Canvas, sty draw.GlyphStyle, pt vg.Point) {
	c.SetLineStyle(draw.LineStyle{Color: sty.Color, Width: g.width})
	var p vg.Path
	p.Move(vg.Point{X: pt.X + sty.Radius, Y: pt.Y})
	p.Arc(pt, sty.Radius, 0, 2*math.Pi)
	p.Close()
	c.Stroke(p)
}

// Figure builds the chart: one panel per prompt length, p50 TTFT (s, log)
// against the link's throughput (MB/s, log), one line per mode; every
// panel shares the y range so heights compare across panels.
func Figure(r *Report) (*chart.Figure, error) {
	prompts := slices.Clone(r.Config.PromptTokens)
	links := slices.Clone(r.Config.LinkMBps)
	slices.Sort(prompts)
	slices.Sort(links)
	c := r.Config
	fig := &chart.Figure{
		Title: "p50 TTFT against KV link speed: --disagg " + strings.Join(c.Modes, " / "),
		Subtitle: fmt.Sprintf("profile %s, %d prefill + %d decode workers, concurrency %d, %d requests per run, KV %d B/token",
			c.Profile, c.PrefillWorkers, c.DecodeWorkers, c.Concurrency, c.Requests, c.KVBytesPerToken),
		XLabel: "KV link throughput (MB/s, log scale)",
		YLabel: "p50 time to first token (s, log scale)",
		Width:  120 + max(len(prompts), 1)*panelWidth + 170,
		Height: plotHeight,
	}
	ylo, yhi := decades(r)
	xlo, xhi := linkRange(links)
	for _, p := range prompts {
		pan := chart.NewPanel(fmt.Sprintf("%d-token prompts", p), "", "")
		pl := pan.Plot
		grid := plotter.NewGrid()
		pl.Add(grid)
		pl.X.Scale, pl.Y.Scale = plot.LogScale{}, plot.LogScale{}
		pl.X.Min, pl.X.Max = xlo, xhi
		pl.Y.Min, pl.Y.Max = ylo, yhi
		pl.X.Tick.Marker = linkTicks(links)
		pl.Y.Tick.Marker = decadeTicks{}
		for _, m := range c.Modes {
			xys := modePoints(r, p, links, m)
			if len(xys) == 0 {
				continue
			}
			s, err := modeSeries(m, xys)
			if err != nil {
				return nil, fmt.Errorf("%d-token prompts, %s: %w", p, m, err)
			}
			pan.Add(s)
		}
		fig.Panels = append(fig.Panels, pan)
	}
	return fig, nil
}

// Plot writes the chart (Figure) as a PNG to path.
func Plot(path string, r *Report) error {
	fig, err := Figure(r)
	if err != nil {
		return err
	}
	return fig.Save(path)
}

// modePoints are mode m's p50 TTFTs in seconds for prompt length p, by
// link speed; a run without a TTFT has no point (a log axis has no 0).
func modePoints(r *Report, p int, links []float64, m string) plotter.XYs {
	var xys plotter.XYs
	for _, l := range links {
		for _, cell := range r.Cells {
			if cell.PromptTokens != p || cell.LinkMBps != l {
				continue
			}
			for _, res := range cell.Results {
				if res.Mode == m && res.TTFT.P50 > 0 {
					xys = append(xys, plotter.XY{X: l, Y: res.TTFT.P50 / 1e3})
				}
			}
		}
	}
	return xys
}

func modeSeries(m string, xys plotter.XYs) (chart.Series, error) {
	st, ok := modeStyle[m]
	if !ok {
		st = modeStyle["off"]
	}
	line, points, err := plotter.NewLinePoints(xys)
	if err != nil {
		return chart.Series{}, err
	}
	col := chart.Color(st.color)
	line.Color, line.Width = col, chart.Px(st.width)
	points.Color, points.Shape, points.Radius = col, st.glyph, chart.Px(st.radius)
	return chart.Series{Label: "--disagg " + m, Plotters: []plot.Plotter{line, points}}, nil
}

// decades is the y range shared by every panel: whole decades of seconds
// around every p50 TTFT.
func decades(r *Report) (lo, hi float64) {
	lo, hi = math.Inf(1), math.Inf(-1)
	for _, cell := range r.Cells {
		for _, res := range cell.Results {
			if v := res.TTFT.P50 / 1e3; v > 0 {
				lo, hi = math.Min(lo, v), math.Max(hi, v)
			}
		}
	}
	if math.IsInf(lo, 0) {
		return 0.01, 1
	}
	dlo, dhi := math.Floor(math.Log10(lo)), math.Ceil(math.Log10(hi))
	if dhi <= dlo {
		dhi = dlo + 1
	}
	return math.Pow(10, dlo), math.Pow(10, dhi)
}

// linkRange pads the link speeds by 6% of their log span on each side, so
// the first and last markers are not cut by the axes.
func linkRange(links []float64) (lo, hi float64) {
	if len(links) == 0 {
		return 1, 10
	}
	a, b := math.Log10(links[0]), math.Log10(links[len(links)-1])
	if b <= a {
		a, b = a-0.5, b+0.5
	}
	pad := 0.06 * (b - a)
	return math.Pow(10, a-pad), math.Pow(10, b+pad)
}

// linkTicks labels the link speeds the grid ran.
func linkTicks(links []float64) plot.ConstantTicks {
	ticks := make(plot.ConstantTicks, len(links))
	for i, l := range links {
		ticks[i] = plot.Tick{Value: l, Label: strconv.FormatFloat(l, 'f', -1, 64)}
	}
	return ticks
}

// decadeTicks labels every power of ten and marks 2…9 times it unlabelled
// (gonum's LogTicks labels in scientific notation).
type decadeTicks struct{}

func (decadeTicks) Ticks(lo, hi float64) []plot.Tick {
	var ticks []plot.Tick
	for d := math.Floor(math.Log10(lo)); d <= math.Ceil(math.Log10(hi)); d++ {
		base := math.Pow(10, d)
		for k := 1.0; k < 10; k++ {
			v := k * base
			if v < lo*(1-1e-9) || v > hi*(1+1e-9) {
				continue
			}
			t := plot.Tick{Value: v}
			if k == 1 {
				t.Label = strconv.FormatFloat(v, 'f', -1, 64)
			}
			ticks = append(ticks, t)
		}
	}
	return ticks
}
