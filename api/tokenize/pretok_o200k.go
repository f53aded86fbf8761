package tokenize

import (
	"unicode"
	"unicode/utf8"
)

// patternO200k is OpenAI's o200k pattern as gpt-oss's tokenizer.json spells
// it.
const patternO200k = `[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+`

// o200kSplitter implements patternO200k:
//
//	A1  P? U* W+ C?
//	A2  P? U+ W* C?
//	A3  \p{N}{1,3}
//	A4   ?[^\s\p{L}\p{N}]+[\r\n/]*
//	A5  \s*[\r\n]+ | \s+(?!\S) | \s+
//
// with P = [^\r\n\p{L}\p{N}] (one rune; note it includes marks and
// whitespace), U = [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] ("upper"), W =
// [\p{Ll}\p{Lm}\p{Lo}\p{M}] ("lower") and C the case-insensitive
// contractions. Lm, Lo and marks are in both U and W.
//
// A backtracking engine tries P? first with a rune, then without. For A1
// it lets U* take the longest run of U, then gives runes back until W+ can
// start: at the first rune after the run if that is W (it can only be an
// Ll), else at the last rune of the run that is also W (Lm, Lo or a mark).
// W+ then runs as far as it can; nothing after it can fail, so that is the
// match. A2 (reached only when A1 fails, i.e. no W rune follows or ends
// the U run) takes the U run and any W run after it. Every rune class has
// an alternative that accepts it, so the pieces tile the text.
type o200kSplitter struct{}

// o200k rune properties.
const (
	o2Upper  = 1 << iota // in U
	o2Lower              // in W
	o2Prefix             // in P
)

func o200kProps(r rune) uint8 {
	if r < 0x80 {
		switch {
		case r >= 'A' && r <= 'Z':
			return o2Upper
		case r >= 'a' && r <= 'z':
			return o2Lower
		case r >= '0' && r <= '9', r == '\r', r == '\n':
			return 0
		}
		return o2Prefix
	}
	switch {
	case unicode.Is(unicode.Lu, r), unicode.Is(unicode.Lt, r):
		return o2Upper
	case unicode.Is(unicode.Ll, r):
		return o2Lower
	case unicode.Is(unicode.Lm, r), unicode.Is(unicode.Lo, r):
		return o2Upper | o2Lower
	case unicode.IsMark(r):
		return o2Upper | o2Lower | o2Prefix
	case unicode.IsNumber(r):
		return 0
	}
	return o2Prefix
}

func (o200kSplitter) next(s string) int {
	_, r, w := class(s)
	prefix := o200kProps(r)&o2Prefix != 0
	// Alternatives in pattern order, P? first with a rune, then without.
	for _, word := range [2]func(string) int{o200kA1, o200kA2} {
		if prefix {
			if n := word(s[w:]); n > 0 {
				return w + n
			}
		}
		if n := word(s); n > 0 {
			return n
		}
	}
	if unicode.IsNumber(r) {
		return w + run(s[w:], classNumber, 2)
	}
	// A4: " ?[^\s\p{L}\p{N}]+[\r\n/]*".
	start := 0
	if r == ' ' {
		start = 1
	}
	if n := run(s[start:], classOther, -1); n > 0 {
		n += start
		for n < len(s) && (s[n] == '\r' || s[n] == '\n' || s[n] == '/') {
			n++
		}
		return n
	}
	return whitespace(s, true)
}

// o200kA1 matches "U* W+ C?" at the start of s and returns its length, 0
// if it does not match.
func o200kA1(s string) int {
	// The U run, remembering where its last W rune starts.
	n, lastBoth := 0, -1
	for n < len(s) {
		r, w := utf8.DecodeRuneInString(s[n:])
		p := o200kProps(r)
		if p&o2Upper == 0 {
			break
		}
		if p&o2Lower != 0 {
			lastBoth = n
		}
		n += w
	}
	wStart := lastBoth // give back runes down to a W rune
	if n < len(s) {
		if r, _ := utf8.DecodeRuneInString(s[n:]); o200kProps(r)&o2Lower != 0 {
			wStart = n // W+ can start right after the whole U run
		}
	}
	if wStart < 0 {
		return 0
	}
	return o200kLowerTail(s, wStart)
}

// o200kA2 matches "U+ W* C?".
func o200kA2(s string) int {
	n := 0
	for n < len(s) {
		r, w := utf8.DecodeRuneInString(s[n:])
		if o200kProps(r)&o2Upper == 0 {
			break
		}
		n += w
	}
	if n == 0 {
		return 0
	}
	return o200kLowerTail(s, n)
}

// o200kLowerTail extends a match from i over the W run and an optional
// contraction.
func o200kLowerTail(s string, i int) int {
	for i < len(s) {
		r, w := utf8.DecodeRuneInString(s[i:])
		if o200kProps(r)&o2Lower == 0 {
			break
		}
		i += w
	}
	if i < len(s) && s[i] == '\'' {
		if c := contraction(s[i+1:], true); c > 0 {
			i += 1 + c
		}
	}
	return i
}
