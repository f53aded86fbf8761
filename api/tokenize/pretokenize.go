package tokenize

import (
	"unicode"
	"unicode/utf8"
)

// Pre-tokenization cuts text into "words" before BPE runs; BPE never merges
// across a cut, so the cut points decide the ids as much as the merges do.
// HF tokenizers cut with a regex run by Oniguruma (a backtracking engine).
// The Qwen2 / Llama-3 pattern uses a negative look-ahead, `\s+(?!\S)`, which
// Go's RE2-based regexp cannot compile, and Go's `\s` is ASCII-only where
// Oniguruma's is Unicode. So instead of a regex we hand-write one scanner per
// known pattern that reproduces the backtracking engine's leftmost-first
// alternation exactly. Unknown patterns are rejected at load time rather
// than approximated.

// The patterns we recognise, verbatim as they appear in tokenizer.json.
const (
	// Qwen2 / Qwen2.5: numbers are split into single digits.
	patternQwen2 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// Llama-3: identical except numbers go in runs of up to three digits.
	patternLlama3 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// GPT-2: also what a ByteLevel pre-tokenizer with use_regex=true applies.
	patternGPT2 = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
)

// splitter cuts pre-tokens off the front of the text: next returns the
// byte length (>= 1) of the first pre-token of a non-empty s. Yielding one
// piece at a time keeps Encode free of a per-call slice of pieces.
type splitter interface {
	next(s string) int
}

// split appends all pre-tokens of s to dst. The pieces are substrings of s
// and concatenate back to s.
func split(sp splitter, dst []string, s string) []string {
	for len(s) > 0 {
		n := sp.next(s)
		dst = append(dst, s[:n])
		s = s[n:]
	}
	return dst
}

// splitterFor returns the scanner for a known Split regex.
func splitterFor(pattern string) (splitter, bool) {
	switch pattern {
	case patternQwen2:
		return llamaSplitter{maxDigits: 1}, true
	case patternLlama3:
		return llamaSplitter{maxDigits: 3}, true
	case patternGPT2:
		return gpt2Splitter{}, true
	case patternO200k:
		return o200kSplitter{}, true
	}
	return nil, false
}

// charClass partitions all runes the way the patterns do: \p{L}, \p{N}, \s
// and everything else ([^\s\p{L}\p{N}]). The four are disjoint.
type charClass uint8

const (
	classOther charClass = iota
	classLetter
	classNumber
	classSpace
)

// asciiClasses is the fast path for ASCII. Note that the C0 "information
// separators" 0x1C-0x1F are not White_Space (Python's str.isspace says they
// are, Oniguruma and Go agree they are not).
var asciiClasses = func() (t [utf8.RuneSelf]charClass) {
	for c := range t {
		t[c] = classOf(rune(c))
	}
	return t
}()

// classOf classifies by Unicode general category. Oniguruma's `\s` is the
// White_Space property, which is exactly unicode.IsSpace.
func classOf(r rune) charClass {
	switch {
	case unicode.IsLetter(r):
		return classLetter
	case unicode.IsNumber(r):
		return classNumber
	case unicode.IsSpace(r):
		return classSpace
	}
	return classOther
}

// class decodes the first rune of s. For an invalid byte it reports U+FFFD
// (a symbol, so classOther) with width 1; the encoder sanitises input first,
// this only keeps the scanners total.
func class(s string) (charClass, rune, int) {
	if c := s[0]; c < utf8.RuneSelf {
		return asciiClasses[c], rune(c), 1
	}
	r, w := utf8.DecodeRuneInString(s)
	return classOf(r), r, w
}

// run returns the byte length of the longest prefix of s whose runes are all
// of class c, taking at most max runes (max < 0: unbounded).
func run(s string, c charClass, max int) int {
	n := 0
	for k := 0; n < len(s) && (max < 0 || k < max); k++ {
		cc, _, w := class(s[n:])
		if cc != c {
			break
		}
		n += w
	}
	return n
}

// contractions are the alternatives of `'s|'t|'re|'ve|'m|'ll|'d`, in
// pattern order (which matters only in that the first match wins).
var contractions = [...]string{"s", "t", "re", "ve", "m", "ll", "d"}

// contraction returns the length of the contraction suffix at the start of s
// (the text after an apostrophe), or 0. With fold, letters compare by simple
// case folding like Oniguruma's (?i:...): "'S" matches, and so does "'ſ"
// (U+017F LATIN SMALL LETTER LONG S, which folds to 's').
func contraction(s string, fold bool) int {
	for _, c := range contractions {
		n := 0
		ok := true
		for i := 0; i < len(c); i++ {
			if n >= len(s) {
				ok = false
				break
			}
			r, w := utf8.DecodeRuneInString(s[n:])
			if !sameLetter(r, rune(c[i]), fold) {
				ok = false
				break
			}
			n += w
		}
		if ok {
			return n
		}
	}
	return 0
}

func sameLetter(r, c rune, fold bool) bool {
	if r == c {
		return true
	}
	if !fold {
		return false
	}
	for f := unicode.SimpleFold(c); f != c; f = unicode.SimpleFold(f) {
		if f == r {
			return true
		}
	}
	return false
}

// whitespace matches the whitespace alternatives at the start of s, whose
// first rune is whitespace:
//
//	\s*[\r\n]+   (only if newlines)  up to and including the last \r or \n
//	                                 of the whitespace run;
//	\s+(?!\S)                        the whole run if it ends the text, else
//	                                 all but its last rune, which is left to
//	                                 prefix the next word (" world");
//	\s+                              a lone whitespace rune before a \S.
func whitespace(s string, newlines bool) int {
	end, lastStart, lastNL, count := 0, 0, 0, 0
	for end < len(s) {
		c, r, w := class(s[end:])
		if c != classSpace {
			break
		}
		if r == '\r' || r == '\n' {
			lastNL = end + w
		}
		lastStart = end
		end += w
		count++
	}
	switch {
	case newlines && lastNL > 0:
		return lastNL
	case end == len(s) || count == 1:
		return end
	default:
		return lastStart
	}
}

// llamaSplitter implements patternQwen2 (maxDigits 1) and patternLlama3
// (maxDigits 3):
//
//	(?i:'s|'t|'re|'ve|'m|'ll|'d)
//	|[^\r\n\p{L}\p{N}]?\p{L}+
//	|\p{N}{1,maxDigits}
//	| ?[^\s\p{L}\p{N}]+[\r\n]*
//	|\s*[\r\n]+
//	|\s+(?!\S)
//	|\s+
type llamaSplitter struct{ maxDigits int }

// next returns the length of the match at the start of the non-empty s. The
// alternatives are tried in pattern order; the first that matches wins, as
// in a backtracking engine. Every rune is in one of the four classes and
// each class has an alternative that accepts it, so some alternative always
// matches and the pieces tile the text.
func (p llamaSplitter) next(s string) int {
	c, r, w := class(s)
	if r == '\'' {
		if n := contraction(s[1:], true); n > 0 {
			return 1 + n
		}
	}
	switch c {
	case classLetter:
		return w + run(s[w:], classLetter, -1)
	case classNumber:
		return w + run(s[w:], classNumber, p.maxDigits-1)
	}
	// [^\r\n\p{L}\p{N}]? before letters: any one other or whitespace rune
	// except CR and LF (" world", "\tfoo", "(bar").
	if r != '\r' && r != '\n' && w < len(s) {
		if n := run(s[w:], classLetter, -1); n > 0 {
			return w + n
		}
	}
	// " ?[^\s\p{L}\p{N}]+[\r\n]*": punctuation, with at most one leading
	// space (U+0020 only) and the newlines that follow it.
	start := 0
	if r == ' ' {
		start = 1
	}
	if n := run(s[start:], classOther, -1); n > 0 {
		n += start
		for n < len(s) && (s[n] == '\r' || s[n] == '\n') {
			n++
		}
		return n
	}
	return whitespace(s, true)
}

// gpt2Splitter implements patternGPT2:
//
//	's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
type gpt2Splitter struct{}

func (gpt2Splitter) next(s string) int {
	c, r, w := class(s)
	if r == '\'' {
		if n := contraction(s[1:], false); n > 0 {
			return 1 + n
		}
	}
	// An optional leading space only matters when it is followed by a
	// non-space run; the three " ?X+" alternatives then agree on the class
	// of the rune after it.
	if r == ' ' && len(s) > 1 {
		if c2, _, w2 := class(s[1:]); c2 != classSpace {
			return 1 + w2 + run(s[1+w2:], c2, -1)
		}
	}
	if c != classSpace {
		return w + run(s[w:], c, -1)
	}
	return whitespace(s, false)
}
