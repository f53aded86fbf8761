package tokenize

import (
	"unicode"
	"unicode/utf8"
)

// DeepSeek V3 pre-tokenises with three Isolated Splits in a row: digit runs
// of up to three, runs of common CJK ideographs and kana, then
// patternDeepSeekWords inside each resulting piece. The second runs on
// Go's regexp (see regex.go); the other two have scanners here.

const (
	patternDigits3       = `\p{N}{1,3}`
	patternDeepSeekWords = "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
)

// digitRunMatcher finds `\p{N}{1,max}`: the first number rune and up to
// max-1 more.
type digitRunMatcher struct{ max int }

func (d digitRunMatcher) find(s string) (int, int, bool) {
	for i := 0; i < len(s); {
		c, _, w := class(s[i:])
		if c == classNumber {
			return i, i + w + run(s[i+w:], classNumber, d.max-1), true
		}
		i += w
	}
	return 0, 0, false
}

// deepseekMatcher finds patternDeepSeekWords:
//
//	A1  [ASCII punctuation][A-Za-z]+
//	A2  [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+
//	A3   ?[\p{P}\p{S}]+[\r\n]*
//	A4  \s*[\r\n]+ | \s+(?!\S) | \s+
//
// Unlike the other patterns it does not match everywhere: a rune that is
// not a letter, mark, punctuation, symbol or whitespace (digits, format
// characters such as ZWJ, controls, private use) matches only as the
// prefix of A2. The regex engine then tries the next position, so such
// runes end up in the gaps between matches, which Isolated keeps as
// pieces of their own.
type deepseekMatcher struct{}

// DeepSeek rune classes. They partition all runes: no whitespace rune is a
// letter, mark, punctuation or symbol.
const (
	dsOther = iota // anything else: numbers, Cc, Cf, Co, Cn
	dsLetter
	dsMark
	dsPunct // \p{P} or \p{S}
	dsSpace
)

func dsClass(r rune) uint8 {
	if r < 0x80 {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z':
			return dsLetter
		case r >= '0' && r <= '9':
			return dsOther
		case r == ' ', r >= '\t' && r <= '\r':
			return dsSpace
		case r > ' ' && r < 0x7f:
			return dsPunct // all printable ASCII non-alphanumerics are P or S
		}
		return dsOther
	}
	switch {
	case unicode.IsLetter(r):
		return dsLetter
	case unicode.IsMark(r):
		return dsMark
	case unicode.IsPunct(r), unicode.IsSymbol(r):
		return dsPunct
	case unicode.IsSpace(r):
		return dsSpace
	}
	return dsOther
}

func (deepseekMatcher) find(s string) (int, int, bool) {
	for i := 0; i < len(s); {
		if n := deepseekAt(s[i:]); n > 0 {
			return i, i + n, true
		}
		_, w := utf8.DecodeRuneInString(s[i:])
		i += w
	}
	return 0, 0, false
}

// deepseekAt returns the length of the match starting at s[0], 0 if none.
func deepseekAt(s string) int {
	r, w := utf8.DecodeRuneInString(s)
	c := dsClass(r)
	// A1: the 32 ASCII punctuation and symbol characters are exactly the
	// printable ASCII runes of class dsPunct.
	if r < 0x80 && c == dsPunct {
		n := w
		for n < len(s) && (s[n]|0x20 >= 'a' && s[n]|0x20 <= 'z') {
			n++
		}
		if n > w {
			return n
		}
	}
	// A2. A mark is both a possible prefix and a [\p{L}\p{M}] rune, so
	// with or without the prefix the match is the run from s[0].
	if c == dsLetter || c == dsMark {
		return w + dsLetterRun(s[w:])
	}
	if (c == dsOther || c == dsSpace) && r != '\r' && r != '\n' {
		if n := dsLetterRun(s[w:]); n > 0 {
			return w + n
		}
	}
	// A3.
	start := 0
	if r == ' ' {
		start = 1
	}
	if n := dsPunctRun(s[start:]); n > 0 {
		n += start
		for n < len(s) && (s[n] == '\r' || s[n] == '\n') {
			n++
		}
		return n
	}
	if c == dsSpace {
		return whitespace(s, true)
	}
	return 0
}

// dsLetterRun is the length of the [\p{L}\p{M}]* run at the start of s.
func dsLetterRun(s string) int {
	n := 0
	for n < len(s) {
		r, w := utf8.DecodeRuneInString(s[n:])
		if c := dsClass(r); c != dsLetter && c != dsMark {
			break
		}
		n += w
	}
	return n
}

// dsPunctRun is the length of the [\p{P}\p{S}]* run at the start of s.
func dsPunctRun(s string) int {
	n := 0
	for n < len(s) {
		r, w := utf8.DecodeRuneInString(s[n:])
		if dsClass(r) != dsPunct {
			break
		}
		n += w
	}
	return n
}
