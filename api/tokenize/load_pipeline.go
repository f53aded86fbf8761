package tokenize

import (
	"encoding/json"
	"fmt"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// parseNormalizer builds the normalizer; nil means none.
func parseNormalizer(raw json.RawMessage) (normalizer, error) {
	if isNull(raw) {
		return nil, nil
	}
	c, err := component(raw, "normalizer")
	if err != nil {
		return nil, err
	}
	switch c.Type {
	case "NFC":
		return normForm{norm.NFC}, nil
	case "NFD":
		return normForm{norm.NFD}, nil
	case "NFKC":
		return normForm{norm.NFKC}, nil
	case "NFKD":
		return normForm{norm.NFKD}, nil
	case "Prepend":
		if c.Prepend == nil {
			return nil, fmt.Errorf("normalizer Prepend: missing prepend")
		}
		return normPrepend{*c.Prepend}, nil
	case "Replace":
		if c.Content == nil {
			return nil, fmt.Errorf("normalizer Replace: missing content")
		}
		m, lit, err := patternMatcher(c.Pattern)
		if err != nil {
			return nil, fmt.Errorf("normalizer Replace: %w", err)
		}
		if lit != "" {
			return normReplace{literal: lit, content: *c.Content}, nil
		}
		return normReplace{re: m, content: *c.Content}, nil
	case "Sequence":
		var seq normSequence
		for i, sub := range c.Normalizers {
			n, err := parseNormalizer(sub)
			if err != nil {
				return nil, fmt.Errorf("normalizer %d: %w", i, err)
			}
			if n != nil {
				seq = append(seq, n)
			}
		}
		switch len(seq) {
		case 0:
			return nil, nil
		case 1:
			return seq[0], nil
		}
		return seq, nil
	}
	return nil, unsupported("normalizer type %q", c.Type)
}

// parsePreTokenizer builds the pre-tokenizer chain. A file without one
// (Llama 2) hands each normalised stretch to the model whole.
func parsePreTokenizer(raw json.RawMessage) (*preTokenizer, error) {
	pt := &preTokenizer{}
	if isNull(raw) {
		return pt, nil
	}
	if err := addPreStages(pt, raw); err != nil {
		return nil, err
	}
	// The stream fast path: [Split(Isolated, tiling scanner)] or
	// [ByteLevel(use_regex)], each optionally followed by a ByteLevel
	// that neither splits nor adds a space.
	st := pt.stages
	if n := len(st); n > 0 {
		if bl, ok := st[n-1].(byteLevelStage); ok && !bl.useRegex && !bl.prefixSpace && n > 1 {
			st = st[:n-1]
		}
	}
	if len(st) == 1 {
		switch s := st[0].(type) {
		case splitStage:
			if sm, ok := s.m.(scannerMatcher); ok && s.behavior == behaviorIsolated && !s.invert {
				pt.stream = sm.sp
			}
		case byteLevelStage:
			if s.useRegex {
				pt.stream, pt.prefixSpace = gpt2Splitter{}, s.prefixSpace
			}
		}
	}
	return pt, nil
}

func addPreStages(pt *preTokenizer, raw json.RawMessage) error {
	c, err := component(raw, "pre_tokenizer")
	if err != nil {
		return err
	}
	if pt.byteLevel {
		// ByteLevel maps the text to byte-level runes; a stage after it
		// would see those, which we do not model.
		return unsupported("pre_tokenizer %q after ByteLevel", c.Type)
	}
	switch c.Type {
	case "Sequence":
		for i, sub := range c.PreTokenizers {
			if err := addPreStages(pt, sub); err != nil {
				return fmt.Errorf("pre_tokenizer %d: %w", i, err)
			}
		}
		return nil
	case "Split":
		b, ok := behaviors[c.Behavior]
		if !ok {
			return fmt.Errorf("pre_tokenizer Split: unknown behavior %q", c.Behavior)
		}
		m, _, err := patternMatcher(c.Pattern)
		if err != nil {
			return fmt.Errorf("pre_tokenizer Split: %w", err)
		}
		pt.stages = append(pt.stages, splitStage{m: m, behavior: b, invert: c.Invert})
		return nil
	case "Digits":
		b := behaviorContiguous
		if c.IndividualDigits {
			b = behaviorIsolated
		}
		pt.stages = append(pt.stages, splitStage{m: runeMatcher(isNumeric), behavior: b})
		return nil
	case "ByteLevel":
		// HF's defaults: add_prefix_space true, use_regex true.
		st := byteLevelStage{prefixSpace: true, useRegex: true}
		if c.AddPrefixSpace != nil {
			st.prefixSpace = *c.AddPrefixSpace
		}
		if c.UseRegex != nil {
			st.useRegex = *c.UseRegex
		}
		pt.stages = append(pt.stages, st)
		pt.byteLevel = true
		return nil
	case "Metaspace":
		return addMetaspace(pt, c)
	}
	return unsupported("pre_tokenizer type %q", c.Type)
}

func addMetaspace(pt *preTokenizer, c hfComponent) error {
	if c.Replacement == nil || utf8.RuneCountInString(*c.Replacement) != 1 {
		return fmt.Errorf("pre_tokenizer Metaspace: replacement must be one character")
	}
	repl, _ := utf8.DecodeRuneInString(*c.Replacement)
	st := metaspaceStage{repl: repl, scheme: prependAlways, cut: true}
	if c.PrependScheme != nil {
		switch *c.PrependScheme {
		case "always":
		case "first":
			st.scheme = prependFirst
		case "never":
			st.scheme = prependNever
		default:
			return fmt.Errorf("pre_tokenizer Metaspace: unknown prepend_scheme %q", *c.PrependScheme)
		}
	}
	if c.AddPrefixSpace != nil && !*c.AddPrefixSpace {
		// HF refuses this even when prepend_scheme is absent (its
		// default, "always", is not "never").
		if st.scheme != prependNever {
			return fmt.Errorf("pre_tokenizer Metaspace: add_prefix_space does not match prepend_scheme")
		}
		st.scheme = prependNever
	}
	if c.Split != nil {
		st.cut = *c.Split
	}
	if st.scheme == prependFirst && len(pt.stages) > 0 {
		// "first" asks whether a piece starts at offset 0 of the input,
		// which after earlier stages depends on HF's offset alignment
		// through the normalizer; we only track it exactly for the
		// first stage.
		return unsupported("Metaspace prepend_scheme \"first\" after another pre-tokenizer")
	}
	pt.stages = append(pt.stages, st)
	return nil
}
