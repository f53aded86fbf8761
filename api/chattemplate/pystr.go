package chattemplate

import "strings"

// pyIsSpace is Python's str.isspace for one rune: Unicode White_Space plus
// the ASCII information separators U+001C..U+001F, which Go's
// unicode.IsSpace leaves out.
func pyIsSpace(r rune) bool {
	switch r {
	case ' ', '\t', '\n', '\v', '\f', '\r', 0x1c, 0x1d, 0x1e, 0x1f, 0x85, 0xa0,
		0x1680, 0x2028, 0x2029, 0x202f, 0x205f, 0x3000:
		return true
	}
	return r >= 0x2000 && r <= 0x200a
}

// pyStrip is Python's str.strip() without arguments.
func pyStrip(s string) string { return strings.TrimFunc(s, pyIsSpace) }

// pyRstrip is Python's str.rstrip() without arguments.
func pyRstrip(s string) string { return strings.TrimRightFunc(s, pyIsSpace) }
