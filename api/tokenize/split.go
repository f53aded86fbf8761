package tokenize

import (
	"strings"
	"unicode"
	"unicode/utf8"
)

// This file is HF's Split pre-tokenizer (and the Digits one, which is a
// Split on numeric characters): find the pattern's matches, then turn
// matches and the gaps between them into pieces according to the behavior.

// matcher finds the leftmost match of a Split pattern in s. Matches are
// never empty (patterns that can match the empty string are refused at
// load time).
type matcher interface {
	find(s string) (start, end int, ok bool)
}

// splitBehavior is HF's SplitDelimiterBehavior.
type splitBehavior uint8

const (
	behaviorIsolated splitBehavior = iota
	behaviorRemoved
	behaviorMergedWithPrevious
	behaviorMergedWithNext
	behaviorContiguous
)

var behaviors = map[string]splitBehavior{
	"Isolated":           behaviorIsolated,
	"Removed":            behaviorRemoved,
	"MergedWithPrevious": behaviorMergedWithPrevious,
	"MergedWithNext":     behaviorMergedWithNext,
	"Contiguous":         behaviorContiguous,
}

// span is a stretch of the input: a match of the pattern or a gap.
type span struct {
	start, end int
	match      bool
}

// spans tiles s with the matches of m and the gaps between them
// (Pattern::find_matches), inverting the flags if invert.
func spans(dst []span, m matcher, s string, invert bool) []span {
	pos := 0
	for pos < len(s) {
		start, end, ok := m.find(s[pos:])
		if !ok {
			break
		}
		if start > 0 {
			dst = append(dst, span{pos, pos + start, invert})
		}
		dst = append(dst, span{pos + start, pos + end, !invert})
		pos += end
	}
	if pos < len(s) {
		dst = append(dst, span{pos, len(s), invert})
	}
	return dst
}

// applyBehavior merges or drops spans as NormalizedString::split does and
// appends the resulting pieces, as spans, to dst.
func applyBehavior(dst, sp []span, b splitBehavior) []span {
	switch b {
	case behaviorIsolated:
		dst = append(dst, sp...)
	case behaviorRemoved:
		for _, x := range sp {
			if !x.match {
				dst = append(dst, x)
			}
		}
	case behaviorContiguous, behaviorMergedWithPrevious:
		// A span joins the previous piece when both have the same flag
		// (Contiguous), or when it is a match following a non-match
		// (MergedWithPrevious).
		n0 := len(dst)
		prev := false
		for _, x := range sp {
			join := len(dst) > n0 && (b == behaviorContiguous && x.match == prev ||
				b == behaviorMergedWithPrevious && x.match && !prev)
			if join {
				dst[len(dst)-1].end = x.end
			} else {
				dst = append(dst, x)
			}
			prev = x.match
		}
	case behaviorMergedWithNext:
		// Scanning right to left, a match joins the piece after it
		// unless the span after it was a match too.
		n0 := len(dst)
		prev := false
		for i := len(sp) - 1; i >= 0; i-- {
			x := sp[i]
			if x.match && !prev && len(dst) > n0 {
				dst[len(dst)-1].start = x.start
			} else {
				dst = append(dst, x)
			}
			prev = x.match
		}
		for i, j := n0, len(dst)-1; i < j; i, j = i+1, j-1 {
			dst[i], dst[j] = dst[j], dst[i]
		}
	}
	return dst
}

// literalMatcher matches a fixed string (a Split or Replace String
// pattern).
type literalMatcher string

func (l literalMatcher) find(s string) (int, int, bool) {
	i := strings.Index(s, string(l))
	if i < 0 {
		return 0, 0, false
	}
	return i, i + len(l), true
}

// runeMatcher matches any single rune for which the predicate holds
// (Digits: char::is_numeric; Metaspace: the replacement character).
type runeMatcher func(rune) bool

func (f runeMatcher) find(s string) (int, int, bool) {
	for i, r := range s {
		if f(r) {
			return i, i + utf8.RuneLen(r), true
		}
	}
	return 0, 0, false
}

// isNumeric is Rust's char::is_numeric: general categories Nd, Nl, No.
func isNumeric(r rune) bool { return unicode.IsNumber(r) }

// scannerMatcher adapts a splitter whose pattern matches at every position
// (so its matches tile the text) to the matcher interface.
type scannerMatcher struct{ sp splitter }

func (m scannerMatcher) find(s string) (int, int, bool) {
	if s == "" {
		return 0, 0, false
	}
	return 0, m.sp.next(s), true
}
