// Package chart lays out kvbench's PNG figures with gonum.org/v1/plot: a
// title and a subtitle, panels side by side with aligned axes, and one
// legend for all of them on the right. The figures themselves (which
// panels, which series) are built by the report and disagg packages; this
// package holds only what they share, so the two charts look alike.
//
// A Figure is built first and rendered after, so tests can inspect its
// panels, axis labels and series before any pixel is drawn.
package chart

import (
	"bufio"
	"errors"
	"fmt"
	"image/color"
	"io"
	"math"
	"os"

	xfont "golang.org/x/image/font"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/font"
	"gonum.org/v1/plot/text"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// DPI is the resolution figures are rendered at: a Figure's Width and
// Height are pixels at this resolution, font sizes are points.
const DPI = 96

// Px converts pixels at DPI to a drawing length.
func Px(n float64) vg.Length { return vg.Length(n) * vg.Inch / DPI }

// Figure is a chart before rendering.
type Figure struct {
	Title    string // what the figure shows
	Subtitle string // the run it comes from (workload, fleet, seed)
	Panels   []*Panel
	// XLabel and YLabel, when set, are one axis label below and left of
	// the panels, for panels that share the axis. They are drawn by the
	// figure, not the panels: gonum reserves room for a panel's own axis
	// label around the axis' arithmetic middle, which on a log axis is near
	// its end, and so pads the panel on that side by half the label.
	XLabel, YLabel string
	// Width and Height are the PNG's size in pixels.
	Width, Height int
}

// Panel is one plot of a figure and the series drawn on it.
type Panel struct {
	Plot   *plot.Plot
	Series []Series
}

// Series is one named thing drawn on a panel (a policy's bar, a mode's
// line): its label goes into the figure's legend once, drawn with the
// thumbnails of its plotters.
type Series struct {
	Label    string
	Plotters []plot.Plotter
}

// NewPanel returns a panel with its title and axis labels set in the
// figures' sans-serif font (gonum's default is a serif font).
func NewPanel(title, xLabel, yLabel string) *Panel {
	p := plot.New()
	p.Title.Text = title
	p.Title.TextStyle.Font = Font(13, true)
	p.Title.Padding = Px(8)
	p.X.Label.Text = xLabel
	p.Y.Label.Text = yLabel
	for _, a := range []*plot.Axis{&p.X, &p.Y} {
		a.Label.TextStyle.Font = Font(11, false)
		a.Tick.Label.Font = Font(10, false)
	}
	return &Panel{Plot: p}
}

// Add draws s on the panel.
func (p *Panel) Add(s Series) {
	p.Plot.Add(s.Plotters...)
	p.Series = append(p.Series, s)
}

// Font is the figures' typeface (Liberation Sans, embedded by gonum) at
// size points.
func Font(size vg.Length, bold bool) font.Font {
	f := font.Font{Typeface: "Liberation", Variant: "Sans", Size: size}
	if bold {
		f.Weight = xfont.WeightBold
	}
	return f
}

// TextStyle is a text style in the figures' font.
func TextStyle(size vg.Length, bold bool) text.Style {
	return text.Style{Color: color.Black, Font: Font(size, bold), Handler: plot.DefaultTextHandler}
}

// Palette is the series colours (matplotlib's tab10, readable in print).
var palette = []color.RGBA{
	{31, 119, 180, 255}, {255, 127, 14, 255}, {44, 160, 44, 255}, {214, 39, 40, 255},
	{148, 103, 189, 255}, {140, 86, 75, 255}, {227, 119, 194, 255}, {127, 127, 127, 255},
	{188, 189, 34, 255}, {23, 190, 207, 255},
}

// Color is the i-th series colour.
func Color(i int) color.RGBA { return palette[i%len(palette)] }

// LegendLabels are the figure's legend entries in order: every series
// label, once, as first met panel by panel.
func (f *Figure) LegendLabels() []string {
	var out []string
	for _, e := range f.legendEntries() {
		out = append(out, e.Label)
	}
	return out
}

func (f *Figure) legendEntries() []Series {
	seen := map[string]bool{}
	var out []Series
	for _, p := range f.Panels {
		for _, s := range p.Series {
			if s.Label == "" || seen[s.Label] {
				continue
			}
			seen[s.Label] = true
			out = append(out, s)
		}
	}
	return out
}

// WritePNG renders the figure as a PNG of Width × Height pixels.
func (f *Figure) WritePNG(w io.Writer) error {
	if f.Width <= 0 || f.Height <= 0 {
		return fmt.Errorf("chart: size %d×%d pixels", f.Width, f.Height)
	}
	if len(f.Panels) == 0 {
		return errors.New("chart: no panels")
	}
	c := vgimg.NewWith(vgimg.UseWH(Px(float64(f.Width)), Px(float64(f.Height))), vgimg.UseDPI(DPI),
		vgimg.UseBackgroundColor(color.White))
	f.draw(draw.New(c))
	_, err := vgimg.PngCanvas{Canvas: c}.WriteTo(w)
	return err
}

// Save writes the PNG to path.
func (f *Figure) Save(path string) error {
	out, err := os.Create(path)
	if err != nil {
		return err
	}
	bw := bufio.NewWriter(out)
	if err := f.WritePNG(bw); err != nil {
		out.Close()
		return fmt.Errorf("%s: %w", path, err)
	}
	if err := bw.Flush(); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// draw lays the figure out on dc: title and subtitle centred at the top,
// the legend in a column on the right, the panels in one row between.
func (f *Figure) draw(dc draw.Canvas) {
	margin := Px(12)
	top := dc.Max.Y - margin
	mid := (dc.Min.X + dc.Max.X) / 2
	if f.Title != "" {
		st := TextStyle(16, true)
		st.XAlign, st.YAlign = draw.XCenter, draw.YTop
		dc.FillText(st, vg.Point{X: mid, Y: top}, f.Title)
		top -= st.Rectangle(f.Title).Size().Y + Px(6)
	}
	if f.Subtitle != "" {
		st := TextStyle(10, false)
		st.Color = color.Gray{Y: 70}
		st.XAlign, st.YAlign = draw.XCenter, draw.YTop
		dc.FillText(st, vg.Point{X: mid, Y: top}, f.Subtitle)
		top -= st.Rectangle(f.Subtitle).Size().Y + Px(12)
	}

	area := dc
	area.Max.Y = top
	area.Min.Y += margin
	area.Min.X += margin
	area.Max.X -= margin
	if entries := f.legendEntries(); len(entries) > 0 {
		leg := plot.NewLegend()
		leg.TextStyle = TextStyle(12, false)
		leg.Top, leg.Left = true, true
		leg.ThumbnailWidth = Px(28)
		leg.Padding = Px(6)
		for _, s := range entries {
			var thumbs []plot.Thumbnailer
			for _, p := range s.Plotters {
				if t, ok := p.(plot.Thumbnailer); ok {
					thumbs = append(thumbs, t)
				}
			}
			leg.Add(s.Label, thumbs...)
		}
		width := leg.Rectangle(area).Size().X
		col := area
		col.Min.X = area.Max.X - width
		col.Max.Y = area.Max.Y - Px(40) // level with the panels' plot areas, below their titles
		leg.Draw(col)
		area.Max.X = col.Min.X - Px(24)
	}

	if f.XLabel != "" {
		st := TextStyle(11, false)
		st.XAlign, st.YAlign = draw.XCenter, draw.YBottom
		dc.FillText(st, vg.Point{X: (area.Min.X + area.Max.X) / 2, Y: area.Min.Y}, f.XLabel)
		area.Min.Y += st.Height(f.XLabel) + Px(6)
	}
	if f.YLabel != "" {
		st := TextStyle(11, false)
		st.Rotation = math.Pi / 2
		st.XAlign, st.YAlign = draw.XCenter, draw.YTop
		dc.FillText(st, vg.Point{X: area.Min.X, Y: (area.Min.Y + area.Max.Y) / 2}, f.YLabel)
		area.Min.X += st.Height(f.YLabel) + Px(6)
	}

	plots := make([]*plot.Plot, len(f.Panels))
	for i, p := range f.Panels {
		plots[i] = p.Plot
	}
	tiles := draw.Tiles{Rows: 1, Cols: len(plots), PadX: Px(28)}
	cells := plot.Align([][]*plot.Plot{plots}, tiles, area)
	for i, p := range plots {
		p.Draw(cells[0][i])
	}
}
