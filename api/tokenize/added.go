package tokenize

import (
	"strings"
	"unicode"
	"unicode/utf8"
)

// Added tokens (added_tokens in tokenizer.json: <|im_start|>, <|endoftext|>,
// ...) are cut out of the text before anything else and map straight to
// their ids. Otherwise "<|im_start|>" would be BPE'd as '<', '|', 'im', ...
// and the chat markup would hash differently from the worker's.

type addedToken struct {
	id                        uint32
	content                   string
	lstrip, rstrip, singleWrd bool
}

// addedMatcher finds added tokens leftmost-longest, like the Aho-Corasick
// automaton (MatchKind::LeftmostLongest) HF uses: scanning left to right,
// the first position where any token matches wins, and there the longest
// token. Tokens are indexed by first byte; added vocabularies are small and
// their first bytes ('<', '[') rare in prose, so this is fast enough.
type addedMatcher struct {
	byFirst [256][]addedToken // longest first
	// firsts holds the distinct first bytes; when all are ASCII the scan
	// jumps between candidates with strings.IndexAny instead of testing
	// every byte.
	firsts    string
	asciiOnly bool
}

func newAddedMatcher(tokens []addedToken) *addedMatcher {
	if len(tokens) == 0 {
		return nil
	}
	m := &addedMatcher{asciiOnly: true}
	for _, t := range tokens {
		b := t.content[0]
		if m.byFirst[b] == nil {
			m.firsts += string(rune(b))
			m.asciiOnly = m.asciiOnly && b < utf8.RuneSelf
		}
		list := append(m.byFirst[b], t)
		// Insertion sort by length, descending; stable so that of two
		// equal contents the first listed wins.
		for i := len(list) - 1; i > 0 && len(list[i].content) > len(list[i-1].content); i-- {
			list[i], list[i-1] = list[i-1], list[i]
		}
		m.byFirst[b] = list
	}
	return m
}

// segment is a piece of text: either an added token or plain text to
// normalise, pre-tokenise and BPE.
type segment struct {
	text  string
	id    uint32
	added bool
}

// split appends the segments of s to dst. A nil matcher yields s whole.
// Empty plain segments are dropped (HF filters them too).
func (m *addedMatcher) split(dst []segment, s string) []segment {
	if m == nil {
		if s != "" {
			dst = append(dst, segment{text: s})
		}
		return dst
	}
	plainFrom := 0 // start of the pending plain text
	for i := 0; i < len(s); {
		if m.asciiOnly {
			k := strings.IndexAny(s[i:], m.firsts)
			if k < 0 {
				break
			}
			i += k
		}
		t, ok := m.match(s[i:])
		if !ok {
			i++
			continue
		}
		start, stop := i, i+len(t.content)
		if t.singleWrd && (endsWithWord(s[:start]) || startsWithWord(s[stop:])) {
			// Inside a word: not a match. The automaton has consumed it
			// anyway, so scanning resumes after it (and the text stays
			// plain).
			i = stop
			continue
		}
		if t.lstrip {
			start = plainFrom + trimRightSpaceLen(s[plainFrom:start])
		}
		if t.rstrip {
			stop += leadingSpaceLen(s[stop:])
		}
		if plainFrom < start {
			dst = append(dst, segment{text: s[plainFrom:start]})
		}
		dst = append(dst, segment{text: s[start:stop], id: t.id, added: true})
		plainFrom, i = stop, stop
	}
	if plainFrom < len(s) {
		dst = append(dst, segment{text: s[plainFrom:]})
	}
	return dst
}

func (m *addedMatcher) match(s string) (addedToken, bool) {
	for _, t := range m.byFirst[s[0]] {
		if len(t.content) <= len(s) && s[:len(t.content)] == t.content {
			return t, true
		}
	}
	return addedToken{}, false
}

// trimRightSpaceLen is the length of s without its trailing whitespace.
func trimRightSpaceLen(s string) int {
	for len(s) > 0 {
		r, w := utf8.DecodeLastRuneInString(s)
		if !unicode.IsSpace(r) {
			break
		}
		s = s[:len(s)-w]
	}
	return len(s)
}

func leadingSpaceLen(s string) int {
	n := 0
	for n < len(s) {
		r, w := utf8.DecodeRuneInString(s[n:])
		if !unicode.IsSpace(r) {
			break
		}
		n += w
	}
	return n
}

// isWordRune approximates the Unicode `\w` of Rust's regex crate, which HF
// uses for single_word: Alphabetic, marks, decimal digits, connector
// punctuation and the joiners.
func isWordRune(r rune) bool {
	return unicode.IsLetter(r) || unicode.IsMark(r) || unicode.Is(unicode.Nd, r) ||
		unicode.Is(unicode.Nl, r) || unicode.Is(unicode.Pc, r) ||
		unicode.Is(unicode.Other_Alphabetic, r) || r == 0x200C || r == 0x200D
}

func endsWithWord(s string) bool {
	r, _ := utf8.DecodeLastRuneInString(s)
	return s != "" && isWordRune(r)
}

func startsWithWord(s string) bool {
	r, _ := utf8.DecodeRuneInString(s)
	return s != "" && isWordRune(r)
}
