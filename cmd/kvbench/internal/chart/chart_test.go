package chart

import (
	"bytes"
	"image/png"
	"slices"
	"strings"
	"testing"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
)

func line(t *testing.T, ys ...float64) plot.Plotter {
	t.Helper()
	xys := make(plotter.XYs, len(ys))
	for i, y := range ys {
		xys[i] = plotter.XY{X: float64(i), Y: y}
	}
	l, err := plotter.NewLine(xys)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func TestFigureLegendAndPNG(t *testing.T) {
	a, b := NewPanel("left", "x (s)", "y (ms)"), NewPanel("right", "x (s)", "")
	a.Add(Series{Label: "one", Plotters: []plot.Plotter{line(t, 1, 2)}})
	a.Add(Series{Label: "two", Plotters: []plot.Plotter{line(t, 2, 1)}})
	b.Add(Series{Label: "two", Plotters: []plot.Plotter{line(t, 3, 1)}})
	b.Add(Series{Label: "three", Plotters: []plot.Plotter{line(t, 1, 3)}})
	b.Add(Series{Plotters: []plot.Plotter{plotter.NewGrid()}}) // unlabelled: not in the legend
	if a.Plot.Title.Text != "left" || a.Plot.X.Label.Text != "x (s)" || a.Plot.Y.Label.Text != "y (ms)" || a.Plot.Title.TextStyle.Font.Variant != "Sans" {
		t.Errorf("panel: %q %q %q %v", a.Plot.Title.Text, a.Plot.X.Label.Text, a.Plot.Y.Label.Text, a.Plot.Title.TextStyle.Font)
	}
	for _, tc := range []struct {
		name   string
		fig    Figure
		labels []string
		err    string
	}{
		{"two panels", Figure{Title: "t", Subtitle: "s", XLabel: "shared x", YLabel: "shared y", Panels: []*Panel{a, b}, Width: 640, Height: 360}, []string{"one", "two", "three"}, ""},
		{"no title", Figure{Panels: []*Panel{b}, Width: 300, Height: 200}, []string{"two", "three"}, ""},
		{"no panels", Figure{Width: 300, Height: 200}, nil, "no panels"},
		{"no size", Figure{Panels: []*Panel{a}}, []string{"one", "two"}, "size 0×0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.fig.LegendLabels(); !slices.Equal(got, tc.labels) {
				t.Errorf("legend %q, want %q", got, tc.labels)
			}
			var buf bytes.Buffer
			err := tc.fig.WritePNG(&buf)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("error %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			img, err := png.Decode(&buf)
			if err != nil {
				t.Fatal(err)
			}
			if b := img.Bounds(); b.Dx() != tc.fig.Width || b.Dy() != tc.fig.Height {
				t.Errorf("image %v, want %d×%d", b, tc.fig.Width, tc.fig.Height)
			}
		})
	}
}

func TestLinearTicks(t *testing.T) {
	for _, tc := range []struct {
		lo, hi float64
		labels string
	}{
		{0, 110, "0 20 40 60 80 100"},
		{0, 3058, "0 500 1000 1500 2000 2500 3000"},
		{0, 1.1, "0.0 0.2 0.4 0.6 0.8 1.0"},
		{0, 7, "0 1 2 3 4 5 6 7"},
		{5, 5, "5"},
	} {
		var labels []string
		for _, tk := range (LinearTicks{N: 5}).Ticks(tc.lo, tc.hi) {
			if tk.Value < tc.lo || tk.Value > tc.hi {
				t.Errorf("[%v, %v]: tick %v outside", tc.lo, tc.hi, tk.Value)
			}
			if tk.Label != "" {
				labels = append(labels, tk.Label)
			}
		}
		if got := strings.Join(labels, " "); got != tc.labels {
			t.Errorf("[%v, %v]: labels %q, want %q", tc.lo, tc.hi, got, tc.labels)
		}
	}
}
