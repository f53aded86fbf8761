package tokenize

import (
	"fmt"
	"regexp"
	"strings"
)

// HF compiles Split and Replace regexes with Oniguruma, a backtracking
// engine. We run them in one of two ways, and refuse the rest:
//
//   - Patterns we recognise verbatim get a hand-written scanner
//     (pretokenize.go, pretok_o200k.go, pretok_deepseek.go). This covers
//     every pattern with look-around that real tokenizers use.
//   - Other patterns run on Go's regexp if they stay inside a subset where
//     it provably behaves like Oniguruma. Go's regexp picks the same match
//     as a backtracking engine (leftmost-first: "the one that a
//     backtracking implementation would have chosen"); what differs is the
//     meaning of some syntax. Oniguruma's \s \d \w \b and POSIX classes are
//     Unicode, Go's ASCII; its ^ and $ match at every line; (?i) folds
//     differently; `{,n}` and nested or intersected classes parse
//     differently. So the subset is: literals, escaped punctuation, \t \n
//     \r \f \v, \x escapes, \p{...} / \P{...} categories and scripts,
//     character classes with ranges, groups (?:...), alternation and the
//     quantifiers * + ? {n} {n,} {n,m} and their lazy forms. A pattern that
//     can match the empty string is refused too (HF and Go skip empty
//     matches differently).

// knownMatcher returns the scanner for a pattern we recognise verbatim.
func knownMatcher(pattern string) (matcher, bool) {
	switch pattern {
	case patternQwen2, patternLlama3, patternGPT2, patternO200k:
		sp, _ := splitterFor(pattern)
		return scannerMatcher{sp}, true
	case patternDeepSeekWords:
		return deepseekMatcher{}, true
	case patternDigits3:
		return digitRunMatcher{max: 3}, true
	}
	return nil, false
}

// compileRegex returns a matcher for an Oniguruma pattern, or an
// ErrUnsupported error naming the construct we cannot run exactly.
func compileRegex(pattern string) (matcher, error) {
	if m, ok := knownMatcher(pattern); ok {
		return m, nil
	}
	if err := checkSubset(pattern); err != nil {
		return nil, unsupported("regex %q: %v", pattern, err)
	}
	re, err := regexp.Compile(pattern)
	if err != nil {
		return nil, unsupported("regex %q: %v", pattern, err)
	}
	if re.MatchString("") {
		return nil, unsupported("regex %q can match the empty string", pattern)
	}
	return reMatcher{re}, nil
}

// checkSubset scans pattern for syntax outside the subset described above.
func checkSubset(p string) error {
	inClass := false
	for i := 0; i < len(p); i++ {
		c := p[i]
		switch {
		case c == '\\':
			if i+1 >= len(p) {
				return fmt.Errorf("trailing backslash")
			}
			e := p[i+1]
			i++
			switch {
			case e == 'p' || e == 'P', e == 'x', strings.IndexByte("tnrfv", e) >= 0:
				// Categories, scripts, hex and control escapes mean the
				// same in both (Go rejects names it does not know).
			case e < 0x80 && !isAlnum(e):
				// Escaped punctuation is a literal in both.
			default:
				return fmt.Errorf("escape \\%c", e)
			}
		case inClass:
			switch {
			case c == ']':
				inClass = false
			case c == '[':
				return fmt.Errorf("nested character class or POSIX class")
			case c == '&' && i+1 < len(p) && p[i+1] == '&':
				return fmt.Errorf("character class intersection &&")
			}
		case c == '[':
			inClass = true
			// A ']' right after '[' or '[^' is a literal in both.
			if i+1 < len(p) && p[i+1] == '^' {
				i++
			}
			if i+1 < len(p) && p[i+1] == ']' {
				i++
			}
		case c == '.':
			return fmt.Errorf("'.' (newline handling differs)")
		case c == '^' || c == '$':
			return fmt.Errorf("anchor %q (line anchors in Oniguruma)", c)
		case c == '(' && i+1 < len(p) && p[i+1] == '?':
			if i+2 >= len(p) || p[i+2] != ':' {
				return fmt.Errorf("group flags or look-around %q", p[i:min(len(p), i+4)])
			}
		case c == '{' && i+1 < len(p) && p[i+1] == ',':
			return fmt.Errorf("quantifier {,n}")
		}
	}
	if inClass {
		return fmt.Errorf("unterminated character class")
	}
	return nil
}

func isAlnum(c byte) bool {
	return c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z'
}

// reMatcher runs a pattern inside the subset on Go's regexp.
type reMatcher struct{ re *regexp.Regexp }

func (m reMatcher) find(s string) (int, int, bool) {
	loc := m.re.FindStringIndex(s)
	if loc == nil {
		return 0, 0, false
	}
	return loc[0], loc[1], true
}
