package tokenize

import "strings"

// preTokenizer cuts normalised text into the words BPE runs on (BPE never
// merges across a cut). It is HF's pre-tokenizer chain: each stage cuts
// every piece the previous stage produced, and empty pieces are dropped.
type preTokenizer struct {
	stages []preStage
	// stream, when set, is a scanner whose pieces are exactly those of the
	// whole chain (one Isolated Split with a pattern that matches
	// everywhere, plus a ByteLevel that does not split). Encode then cuts
	// one piece at a time without building lists: the common case
	// (Qwen, Llama 3, gpt-oss, GPT-2) stays allocation-free.
	stream splitter
	// prefixSpace (with stream only): ByteLevel's add_prefix_space.
	prefixSpace bool
	// byteLevel: a ByteLevel stage maps the text to byte-level runes, so
	// the model's vocabulary is byte-level (see bpeModel).
	byteLevel bool
}

// piece is a pre-token in the making. first reports whether it starts at
// offset 0 of the input text, which Metaspace's prepend_scheme "first"
// asks about.
type piece struct {
	text  string
	first bool
}

// preStage is one pre-tokenizer; split appends the pieces of p to dst.
type preStage interface {
	split(dst []piece, p piece) []piece
}

// run appends the pre-tokens of s to dst (via scratch, reused).
func (pt *preTokenizer) run(dst, scratch []piece, s string, first bool) ([]piece, []piece) {
	cur := append(dst, piece{s, first})
	for _, st := range pt.stages {
		scratch = scratch[:0]
		for _, p := range cur {
			scratch = st.split(scratch, p)
		}
		cur, scratch = scratch, cur
	}
	return cur, scratch
}

// splitStage is a Split (or Digits) pre-tokenizer.
type splitStage struct {
	m        matcher
	behavior splitBehavior
	invert   bool
}

func (st splitStage) split(dst []piece, p piece) []piece {
	var buf, out [16]span
	sp := spans(buf[:0], st.m, p.text, st.invert)
	for _, x := range applyBehavior(out[:0], sp, st.behavior) {
		if x.end > x.start {
			dst = append(dst, piece{p.text[x.start:x.end], p.first && x.start == 0})
		}
	}
	return dst
}

// prependScheme is Metaspace's prepend_scheme.
type prependScheme uint8

const (
	prependAlways prependScheme = iota
	prependFirst
	prependNever
)

// metaspaceStage replaces spaces by the replacement rune, prepends one per
// prepend_scheme unless the piece already starts with it, and with split
// cuts before each replacement rune (MergedWithNext).
type metaspaceStage struct {
	repl   rune
	scheme prependScheme
	cut    bool
}

func (st metaspaceStage) split(dst []piece, p piece) []piece {
	r := string(st.repl)
	s := strings.ReplaceAll(p.text, " ", r)
	if !strings.HasPrefix(s, r) && (st.scheme == prependAlways || st.scheme == prependFirst && p.first) {
		s = r + s
	}
	if !st.cut {
		return append(dst, piece{s, p.first})
	}
	return splitStage{m: runeMatcher(func(c rune) bool { return c == st.repl }), behavior: behaviorMergedWithNext}.
		split(dst, piece{s, p.first})
}

// byteLevelStage is the ByteLevel pre-tokenizer: an optional prefix space
// and, with use_regex, the GPT-2 split. Its byte-to-rune mapping happens
// inside the model.
type byteLevelStage struct {
	prefixSpace, useRegex bool
}

func (st byteLevelStage) split(dst []piece, p piece) []piece {
	s := p.text
	if st.prefixSpace && !strings.HasPrefix(s, " ") {
		s = " " + s
	}
	if !st.useRegex {
		return append(dst, piece{s, p.first})
	}
	return splitStage{m: scannerMatcher{gpt2Splitter{}}}.split(dst, piece{s, p.first})
}
