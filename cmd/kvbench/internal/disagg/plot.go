package disagg

import (
	"fmt"
	"image"
	"image/color"
	"image/draw"
	"image/png"
	"math"
	"os"
	"slices"
)

var modeColor = map[string]color.RGBA{
	"off":    {31, 119, 180, 255},
	"always": {255, 127, 14, 255},
	"auto":   {44, 160, 44, 255},
}

// Plot writes a PNG: one panel per prompt length, p50 TTFT (log seconds)
// against link speed (log MB/s), one line per mode. Standard library only.
func Plot(path string, r *Report) error {
	img := PlotImage(r)
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

// PlotImage draws the chart.
func PlotImage(r *Report) *image.RGBA {
	prompts := slices.Clone(r.Config.PromptTokens)
	links := slices.Clone(r.Config.LinkMBps)
	slices.Sort(prompts)
	slices.Sort(links)
	const (
		panelW, gap    = 300, 40
		left, top      = 80, 110
		plotH, bottomM = 360, 120
	)
	n := max(len(prompts), 1)
	width := left + n*panelW + (n-1)*gap + 30
	height := top + plotH + bottomM
	img := image.NewRGBA(image.Rect(0, 0, width, height))
	draw.Draw(img, img.Bounds(), image.NewUniform(color.White), image.Point{}, draw.Src)
	ink := color.RGBA{40, 40, 40, 255}
	grid := color.RGBA{225, 225, 225, 255}

	title := "p50 TTFT vs KV link speed: --disagg off / always / auto"
	drawText(img, (width-textWidth(title, 2))/2, 14, title, 2, ink)
	c := r.Config
	sub := fmt.Sprintf("%s, %d prefill + %d decode workers, concurrency %d, %d requests, %d B/token",
		c.Profile, c.PrefillWorkers, c.DecodeWorkers, c.Concurrency, c.Requests, c.KVBytesPerToken)
	drawText(img, (width-textWidth(sub, 1))/2, 40, sub, 1, ink)

	// Shared log axes.
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, cell := range r.Cells {
		for _, res := range cell.Results {
			if v := res.TTFT.P50 / 1e3; v > 0 {
				lo, hi = math.Min(lo, v), math.Max(hi, v)
			}
		}
	}
	if math.IsInf(lo, 0) {
		lo, hi = 0.01, 1
	}
	ylo, yhi := math.Floor(math.Log10(lo)), math.Ceil(math.Log10(hi))
	if yhi <= ylo {
		yhi = ylo + 1
	}
	xlo, xhi := 0.0, 1.0
	if len(links) > 0 {
		xlo, xhi = math.Log10(links[0]), math.Log10(links[len(links)-1])
		if xhi <= xlo {
			xlo, xhi = xlo-0.5, xhi+0.5
		}
	}
	pad := 0.06 * (xhi - xlo)
	xlo, xhi = xlo-pad, xhi+pad
	yOf := func(v float64) int {
		return top + plotH - int(math.Round((math.Log10(v)-ylo)/(yhi-ylo)*float64(plotH)))
	}

	for pi, p := range prompts {
		x0 := left + pi*(panelW+gap)
		x1 := x0 + panelW
		xOf := func(mbps float64) int {
			return x0 + int(math.Round((math.Log10(mbps)-xlo)/(xhi-xlo)*float64(panelW)))
		}
		label := fmt.Sprintf("%d-token prompts", p)
		drawText(img, x0+(panelW-textWidth(label, 2))/2, top-26, label, 2, ink)
		for d := ylo; d <= yhi; d++ {
			y := yOf(math.Pow(10, d))
			hline(img, x0, x1, y, grid)
			if pi == 0 {
				s := decade(d)
				drawText(img, x0-8-textWidth(s, 1), y-3, s, 1, ink)
			}
		}
		for _, l := range links {
			x := xOf(l)
			vline(img, x, top, top+plotH, grid)
			s := fmt.Sprintf("%g", l)
			drawText(img, x-textWidth(s, 1)/2, top+plotH+8, s, 1, ink)
		}
		vline(img, x0, top, top+plotH, ink)
		hline(img, x0, x1, top+plotH, ink)
		xl := "link MB/s"
		drawText(img, x0+(panelW-textWidth(xl, 1))/2, top+plotH+24, xl, 1, ink)
		for _, m := range c.Modes {
			col := modeColor[m]
			var pts []image.Point
			for _, l := range links {
				for _, cell := range r.Cells {
					if cell.PromptTokens != p || cell.LinkMBps != l {
						continue
					}
					for _, res := range cell.Results {
						if res.Mode == m && res.TTFT.P50 > 0 {
							pts = append(pts, image.Pt(xOf(l), yOf(res.TTFT.P50/1e3)))
						}
					}
				}
			}
			thick := 3
			if m == "auto" {
				thick = 1
			}
			for i := 1; i < len(pts); i++ {
				line(img, pts[i-1], pts[i], thick, col)
			}
			for _, pt := range pts {
				marker(img, pt, m, col)
			}
		}
	}
	ylab := "p50 TTFT (s, log)"
	drawText(img, 8, top-50, ylab, 1, ink)
	// Legend.
	x := left
	y := top + plotH + 56
	for _, m := range c.Modes {
		col := modeColor[m]
		line(img, image.Pt(x, y+7), image.Pt(x+30, y+7), 3, col)
		marker(img, image.Pt(x+15, y+7), m, col)
		drawText(img, x+38, y, "--disagg "+m, 2, ink)
		x += 60 + textWidth("--disagg "+m, 2)
	}
	return img
}

func decade(d float64) string {
	v := math.Pow(10, d)
	if v >= 1 {
		return fmt.Sprintf("%.0f", v)
	}
	return fmt.Sprintf("%g", v)
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

// line draws a segment thick pixels wide (Bresenham with a square pen).
func line(img *image.RGBA, a, b image.Point, thick int, c color.Color) {
	dx, dy := abs(b.X-a.X), -abs(b.Y-a.Y)
	sx, sy := sign(b.X-a.X), sign(b.Y-a.Y)
	e := dx + dy
	x, y := a.X, a.Y
	h := thick / 2
	for {
		for oy := -h; oy <= thick-1-h; oy++ {
			for ox := -h; ox <= thick-1-h; ox++ {
				img.Set(x+ox, y+oy, c)
			}
		}
		if x == b.X && y == b.Y {
			return
		}
		e2 := 2 * e
		if e2 >= dy {
			e += dy
			x += sx
		}
		if e2 <= dx {
			e += dx
			y += sy
		}
	}
}

// marker: off a filled square, always a filled disc, auto a ring (drawn on
// top, so it shows where auto coincides with another mode).
func marker(img *image.RGBA, p image.Point, mode string, c color.Color) {
	switch mode {
	case "off":
		draw.Draw(img, image.Rect(p.X-4, p.Y-4, p.X+5, p.Y+5), image.NewUniform(c), image.Point{}, draw.Src)
	case "always":
		for y := -5; y <= 5; y++ {
			for x := -5; x <= 5; x++ {
				if x*x+y*y <= 20 {
					img.Set(p.X+x, p.Y+y, c)
				}
			}
		}
	default:
		for y := -8; y <= 8; y++ {
			for x := -8; x <= 8; x++ {
				if d := x*x + y*y; d <= 64 && d >= 36 {
					img.Set(p.X+x, p.Y+y, c)
				}
			}
		}
	}
}

func abs(x int) int {
	if x < 0 {
		return -x
	}
	return x
}

func sign(x int) int {
	switch {
	case x > 0:
		return 1
	case x < 0:
		return -1
	}
	return 0
}
