package disagg

import (
	"image"
	"image/color"
	"strings"
)

// font5x7 is a 5×7 bitmap font for the chart's labels, one string per glyph:
// seven rows of five pixels, "x" on. Lower case is drawn as upper case;
// unknown runes as a box. (internal/report has its own, unexported.)
var font5x7 = map[rune]string{
	'0': ".xxx. x...x x..xx x.x.x xx..x x...x .xxx.",
	'1': "..x.. .xx.. ..x.. ..x.. ..x.. ..x.. .xxx.",
	'2': ".xxx. x...x ....x ..xx. .x... x.... xxxxx",
	'3': "xxxx. ....x ....x .xxx. ....x ....x xxxx.",
	'4': "...x. ..xx. .x.x. x..x. xxxxx ...x. ...x.",
	'5': "xxxxx x.... xxxx. ....x ....x x...x .xxx.",
	'6': "..xx. .x... x.... xxxx. x...x x...x .xxx.",
	'7': "xxxxx ....x ...x. ..x.. .x... .x... .x...",
	'8': ".xxx. x...x x...x .xxx. x...x x...x .xxx.",
	'9': ".xxx. x...x x...x .xxxx ....x ...x. .xx..",
	'A': "..x.. .x.x. x...x x...x xxxxx x...x x...x",
	'B': "xxxx. x...x x...x xxxx. x...x x...x xxxx.",
	'C': ".xxxx x.... x.... x.... x.... x.... .xxxx",
	'D': "xxx.. x..x. x...x x...x x...x x..x. xxx..",
	'E': "xxxxx x.... x.... xxxx. x.... x.... xxxxx",
	'F': "xxxxx x.... x.... xxxx. x.... x.... x....",
	'G': ".xxxx x.... x.... x.xxx x...x x...x .xxx.",
	'H': "x...x x...x x...x xxxxx x...x x...x x...x",
	'I': ".xxx. ..x.. ..x.. ..x.. ..x.. ..x.. .xxx.",
	'J': "...xx ....x ....x ....x ....x x...x .xxx.",
	'K': "x...x x..x. x.x.. xx... x.x.. x..x. x...x",
	'L': "x.... x.... x.... x.... x.... x.... xxxxx",
	'M': "x...x xx.xx x.x.x x.x.x x...x x...x x...x",
	'N': "x...x xx..x x.x.x x.x.x x..xx x...x x...x",
	'O': ".xxx. x...x x...x x...x x...x x...x .xxx.",
	'P': "xxxx. x...x x...x xxxx. x.... x.... x....",
	'Q': ".xxx. x...x x...x x...x x.x.x x..x. .xx.x",
	'R': "xxxx. x...x x...x xxxx. x.x.. x..x. x...x",
	'S': ".xxxx x.... x.... .xxx. ....x ....x xxxx.",
	'T': "xxxxx ..x.. ..x.. ..x.. ..x.. ..x.. ..x..",
	'U': "x...x x...x x...x x...x x...x x...x .xxx.",
	'V': "x...x x...x x...x x...x .x.x. .x.x. ..x..",
	'W': "x...x x...x x...x x.x.x x.x.x xx.xx x...x",
	'X': "x...x .x.x. ..x.. ..x.. ..x.. .x.x. x...x",
	'Y': "x...x .x.x. ..x.. ..x.. ..x.. ..x.. ..x..",
	'Z': "xxxxx ...x. ...x. ..x.. .x... .x... xxxxx",
	' ': "..... ..... ..... ..... ..... ..... .....",
	'.': "..... ..... ..... ..... ..... ..xx. ..xx.",
	',': "..... ..... ..... ..... ..xx. ...x. ..x..",
	'-': "..... ..... ..... xxxxx ..... ..... .....",
	'+': "..... ..x.. ..x.. xxxxx ..x.. ..x.. .....",
	'=': "..... ..... xxxxx ..... xxxxx ..... .....",
	'/': "....x ....x ...x. ..x.. .x... x.... x....",
	'(': "...x. ..x.. .x... .x... .x... ..x.. ...x.",
	')': ".x... ..x.. ...x. ...x. ...x. ..x.. .x...",
	':': "..... ..xx. ..xx. ..... ..xx. ..xx. .....",
	'%': "xx..x xx..x ...x. ..x.. .x... x..xx x..xx",
	'<': "....x ...x. ..x.. .x... ..x.. ...x. ....x",
	'>': "x.... .x... ..x.. ...x. ..x.. .x... x....",
	'x': "..... ..... x...x .x.x. ..x.. .x.x. x...x", // multiplication sign
	'?': ".xxx. x...x ....x ..xx. ..x.. ..... ..x..",
}

const charW, charH = 5, 7

func glyph(r rune) string {
	if r == '×' {
		r = 'x'
	} else if r >= 'a' && r <= 'z' {
		r -= 'a' - 'A'
	}
	if g, ok := font5x7[r]; ok {
		return g
	}
	return "xxxxx x...x x...x x...x x...x x...x xxxxx"
}

// textWidth is the width of s at scale, one blank column between glyphs.
func textWidth(s string, scale int) int {
	n := len([]rune(s))
	if n == 0 {
		return 0
	}
	return (n*(charW+1) - 1) * scale
}

// drawText draws s with its top-left corner at (x, y).
func drawText(img *image.RGBA, x, y int, s string, scale int, c color.Color) {
	for _, r := range s {
		rows := strings.Fields(glyph(r))
		for gy, row := range rows {
			for gx, px := range row {
				if px != 'x' {
					continue
				}
				for dy := range scale {
					for dx := range scale {
						img.Set(x+gx*scale+dx, y+gy*scale+dy, c)
					}
				}
			}
		}
		x += (charW + 1) * scale
	}
}
