package report

import (
	"fmt"
	"image"
	"image/color"
	"image/draw"
	"image/png"
	"math"
	"os"
)

// Plot writes a PNG with three bar panels per policy: request hit rate,
// TTFT p50 and TTFT p99. Drawn with the standard library only.
func Plot(path, title string, results []Result) error {
	const (
		width, height = 1200, 620
		yTop, yBase   = 90, 500 // plot area rows
		panelW        = 390     // each panel: y labels, then the axes
		left          = 60      // first panel's y-axis
	)
	img := image.NewRGBA(image.Rect(0, 0, width, height))
	draw.Draw(img, img.Bounds(), image.NewUniform(color.White), image.Point{}, draw.Src)
	ink := color.RGBA{40, 40, 40, 255}
	grid := color.RGBA{225, 225, 225, 255}
	scale := 2
	if textWidth(title, 2) > width-20 {
		scale = 1
	}
	drawText(img, (width-textWidth(title, scale))/2, 18, title, scale, ink)

	panels := []struct {
		name string
		unit string
		get  func(Result) float64
	}{
		{"request hit rate", "%", func(r Result) float64 { return 100 * r.RequestHitRate }},
		{"TTFT p50", "ms", func(r Result) float64 { return r.TTFT.P50 }},
		{"TTFT p99", "ms", func(r Result) float64 { return r.TTFT.P99 }},
	}
	for p, pan := range panels {
		x0 := left + p*panelW
		x1 := x0 + panelW - 60
		hi := 0.0
		for _, r := range results {
			hi = math.Max(hi, pan.get(r))
		}
		if pan.unit == "%" {
			hi = 100
		}
		axisMax := niceCeil(hi)
		label := pan.name + " (" + pan.unit + ")"
		drawText(img, x0+(x1-x0-textWidth(label, 2))/2, 48, label, 2, ink)
		// Grid lines and tick labels.
		for k := 0; k <= 5; k++ {
			v := axisMax * float64(k) / 5
			y := yOf(v, axisMax, yBase, yTop)
			hline(img, x0, x1, y, grid)
			s := tick(v)
			drawText(img, x0-6-textWidth(s, 1), y-3, s, 1, ink)
		}
		vline(img, x0, yTop, yBase, ink)
		hline(img, x0, x1, yBase, ink)
		n := max(len(results), 1)
		slot := float64(x1-x0) / float64(n)
		for i, r := range results {
			v := pan.get(r)
			bx0 := x0 + int(slot*float64(i)+slot*0.15)
			bx1 := x0 + int(slot*float64(i+1)-slot*0.15)
			y := yOf(v, axisMax, yBase, yTop)
			draw.Draw(img, image.Rect(bx0, y, bx1, yBase), image.NewUniform(palette[i%len(palette)]), image.Point{}, draw.Src)
			s := barLabel(v)
			drawText(img, (bx0+bx1-textWidth(s, 1))/2, y-10, s, 1, ink)
		}
	}
	// Legend.
	x := left
	for i, r := range results {
		draw.Draw(img, image.Rect(x, 545, x+16, 561), image.NewUniform(palette[i%len(palette)]), image.Point{}, draw.Src)
		drawText(img, x+22, 546, r.Policy, 2, ink)
		x += 22 + textWidth(r.Policy, 2) + 30
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := png.Encode(f, img); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

var palette = []color.RGBA{
	{31, 119, 180, 255}, {255, 127, 14, 255}, {44, 160, 44, 255}, {214, 39, 40, 255},
	{148, 103, 189, 255}, {140, 86, 75, 255}, {227, 119, 194, 255}, {127, 127, 127, 255},
}

// yOf maps v in [0, top] to a pixel row between y0 (bottom) and y1 (top).
func yOf(v, top float64, y0, y1 int) int {
	if top <= 0 {
		return y0
	}
	return y0 - int(math.Round(v/top*float64(y0-y1)))
}

// niceCeil rounds v up to 1, 2 or 5 times a power of ten (at least 1).
func niceCeil(v float64) float64 {
	if v <= 1 || math.IsNaN(v) || math.IsInf(v, 0) {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if v <= m*p {
			return m * p
		}
	}
	return 10 * p
}

func tick(v float64) string {
	switch {
	case v >= 100 || v == math.Trunc(v):
		return fmt.Sprintf("%.0f", v)
	case v >= 10:
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.2f", v)
}

func barLabel(v float64) string {
	if v >= 100 {
		return fmt.Sprintf("%.0f", v)
	}
	return fmt.Sprintf("%.1f", v)
}

func hline(img *image.RGBA, x0, x1, y int, c color.Color) {
	for x := x0; x <= x1; x++ {
		img.Set(x, y, c)
	}
}

func vline(img *image.RGBA, x, y0, y1 int, c color.Color) {
	for y := y0; y <= y1; y++ {
		img.Set(x, y, c)
	}
}
