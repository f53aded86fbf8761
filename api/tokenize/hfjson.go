package tokenize

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
)

// This file reads tokenizer.json. It accepts only the components whose
// behaviour this package reproduces exactly and rejects the rest with
// ErrUnsupported: a tokenizer that loads but disagrees with the worker would
// silently break prefix-cache routing, which is worse than failing to start.

// ErrUnsupported wraps load errors for tokenizer.json features this package
// does not implement (as opposed to malformed files). Callers may fall back
// to Builtin on it.
var ErrUnsupported = errors.New("unsupported tokenizer feature")

// maxTokenID bounds ids so a corrupt file cannot make us allocate a huge
// id -> token table. Real vocabularies are well under a million (Gemma's
// 256k is among the largest).
const maxTokenID = 1 << 21

type hfFile struct {
	AddedTokens  []hfAddedToken  `json:"added_tokens"`
	Normalizer   json.RawMessage `json:"normalizer"`
	PreTokenizer json.RawMessage `json:"pre_tokenizer"`
	Decoder      json.RawMessage `json:"decoder"`
	Model        json.RawMessage `json:"model"`
	// post_processor is deliberately ignored: it only adds BOS/EOS-style
	// tokens when encoding with add_special_tokens=true (or fixes offsets),
	// and Encode has add_special_tokens=false semantics.
}

type hfAddedToken struct {
	ID         *uint32 `json:"id"`
	Content    string  `json:"content"`
	SingleWord bool    `json:"single_word"`
	LStrip     bool    `json:"lstrip"`
	RStrip     bool    `json:"rstrip"`
	Normalized *bool   `json:"normalized"`
	Special    bool    `json:"special"`
}

// hfComponent covers the fields of the normalizer, pre-tokenizer and
// decoder variants we accept; "type" selects the variant.
type hfComponent struct {
	Type           string            `json:"type"`
	Normalizers    []json.RawMessage `json:"normalizers"`
	PreTokenizers  []json.RawMessage `json:"pretokenizers"`
	Decoders       []json.RawMessage `json:"decoders"`
	AddPrefixSpace bool              `json:"add_prefix_space"`
	UseRegex       *bool             `json:"use_regex"`
	Pattern        struct {
		Regex  *string `json:"Regex"`
		String *string `json:"String"`
	} `json:"pattern"`
	Behavior string `json:"behavior"`
	Invert   bool   `json:"invert"`
}

type hfModel struct {
	Type                    string            `json:"type"`
	Dropout                 *float64          `json:"dropout"`
	UnkToken                *string           `json:"unk_token"`
	ContinuingSubwordPrefix *string           `json:"continuing_subword_prefix"`
	EndOfWordSuffix         *string           `json:"end_of_word_suffix"`
	ByteFallback            bool              `json:"byte_fallback"`
	IgnoreMerges            bool              `json:"ignore_merges"`
	Vocab                   map[string]uint32 `json:"vocab"`
	Merges                  []hfMerge         `json:"merges"`
}

// hfMerge accepts both merge encodings: the legacy "a b" string and the
// newer ["a", "b"] pair (which allows spaces inside tokens).
type hfMerge struct{ a, b string }

func (m *hfMerge) UnmarshalJSON(data []byte) error {
	data = bytes.TrimSpace(data)
	if len(data) > 0 && data[0] == '"' {
		var s string
		if err := json.Unmarshal(data, &s); err != nil {
			return err
		}
		parts := strings.Split(s, " ")
		if len(parts) != 2 {
			return fmt.Errorf("merge %q: want two space-separated tokens", s)
		}
		m.a, m.b = parts[0], parts[1]
		return nil
	}
	var pair []string
	if err := json.Unmarshal(data, &pair); err != nil {
		return fmt.Errorf("merge %s: want \"a b\" or [\"a\", \"b\"]", data)
	}
	if len(pair) != 2 {
		return fmt.Errorf("merge %s: want two tokens", data)
	}
	m.a, m.b = pair[0], pair[1]
	return nil
}

func isNull(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) == 0 || bytes.Equal(raw, []byte("null"))
}

func unsupported(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrUnsupported, fmt.Sprintf(format, args...))
}

// parseNormalizer reports whether the normalizer is NFC. Only NFC (alone or
// in a Sequence) is accepted: it is what Qwen2 declares, and other
// normalizers (lowercasing, Replace, Prepend, ...) change ids.
func parseNormalizer(raw json.RawMessage) (nfc bool, err error) {
	if isNull(raw) {
		return false, nil
	}
	var c hfComponent
	if err := json.Unmarshal(raw, &c); err != nil {
		return false, fmt.Errorf("normalizer: %w", err)
	}
	switch c.Type {
	case "NFC":
		return true, nil
	case "Sequence":
		for i, sub := range c.Normalizers {
			n, err := parseNormalizer(sub)
			if err != nil {
				return false, fmt.Errorf("normalizer %d: %w", i, err)
			}
			nfc = nfc || n
		}
		return nfc, nil
	}
	return false, unsupported("normalizer type %q", c.Type)
}

// preTok is the parsed pre-tokenizer: a scanner plus ByteLevel's
// add_prefix_space (only meaningful for the GPT-2 form).
type preTok struct {
	split       splitter
	prefixSpace bool
}

// parsePreTokenizer accepts the two shapes byte-level BPE tokenizers use:
//
//	ByteLevel{use_regex: true}                          (GPT-2, RoBERTa)
//	Sequence[Split{Regex, Isolated}, ByteLevel{use_regex: false}]  (Qwen2, Llama-3)
func parsePreTokenizer(raw json.RawMessage) (preTok, error) {
	if isNull(raw) {
		return preTok{}, unsupported("missing pre_tokenizer (byte-level BPE needs one)")
	}
	var c hfComponent
	if err := json.Unmarshal(raw, &c); err != nil {
		return preTok{}, fmt.Errorf("pre_tokenizer: %w", err)
	}
	switch c.Type {
	case "ByteLevel":
		if c.UseRegex != nil && !*c.UseRegex {
			return preTok{}, unsupported("ByteLevel pre_tokenizer without regex and without a Split")
		}
		return preTok{split: gpt2Splitter{}, prefixSpace: c.AddPrefixSpace}, nil
	case "Sequence":
		if len(c.PreTokenizers) != 2 {
			return preTok{}, unsupported("pre_tokenizer Sequence of %d (want Split, ByteLevel)", len(c.PreTokenizers))
		}
		var split, bl hfComponent
		if err := json.Unmarshal(c.PreTokenizers[0], &split); err != nil {
			return preTok{}, fmt.Errorf("pre_tokenizer 0: %w", err)
		}
		if err := json.Unmarshal(c.PreTokenizers[1], &bl); err != nil {
			return preTok{}, fmt.Errorf("pre_tokenizer 1: %w", err)
		}
		if split.Type != "Split" || bl.Type != "ByteLevel" {
			return preTok{}, unsupported("pre_tokenizer Sequence[%s, %s] (want Split, ByteLevel)", split.Type, bl.Type)
		}
		if split.Pattern.Regex == nil || split.Behavior != "Isolated" || split.Invert {
			return preTok{}, unsupported("Split pre_tokenizer must be a Regex with behavior Isolated, not inverted")
		}
		if (bl.UseRegex == nil || *bl.UseRegex) || bl.AddPrefixSpace {
			return preTok{}, unsupported("ByteLevel after Split must have use_regex=false, add_prefix_space=false")
		}
		sp, ok := splitterFor(*split.Pattern.Regex)
		if !ok {
			return preTok{}, unsupported("Split regex %q", *split.Pattern.Regex)
		}
		return preTok{split: sp}, nil
	}
	return preTok{}, unsupported("pre_tokenizer type %q", c.Type)
}

func parseDecoder(raw json.RawMessage) error {
	if isNull(raw) {
		return unsupported("missing decoder (want ByteLevel)")
	}
	var c hfComponent
	if err := json.Unmarshal(raw, &c); err != nil {
		return fmt.Errorf("decoder: %w", err)
	}
	if c.Type != "ByteLevel" {
		return unsupported("decoder type %q (want ByteLevel)", c.Type)
	}
	return nil
}

// parseModel builds the BPE model, the id -> bytes decode table and the
// spelling -> id map of the model vocabulary.
func parseModel(raw json.RawMessage) (*bpeModel, [][]byte, map[string]uint32, error) {
	if isNull(raw) {
		return nil, nil, nil, errors.New("missing model")
	}
	var hm hfModel
	if err := json.Unmarshal(raw, &hm); err != nil {
		return nil, nil, nil, fmt.Errorf("model: %w", err)
	}
	switch {
	case hm.Type != "BPE" && hm.Type != "":
		return nil, nil, nil, unsupported("model type %q (want BPE)", hm.Type)
	case hm.Dropout != nil && *hm.Dropout != 0:
		return nil, nil, nil, unsupported("BPE dropout (non-deterministic)")
	case hm.ByteFallback:
		return nil, nil, nil, unsupported("BPE byte_fallback")
	case hm.ContinuingSubwordPrefix != nil && *hm.ContinuingSubwordPrefix != "",
		hm.EndOfWordSuffix != nil && *hm.EndOfWordSuffix != "":
		return nil, nil, nil, unsupported("BPE subword prefix/suffix")
	case len(hm.Vocab) == 0:
		return nil, nil, nil, errors.New("model: empty vocab")
	}

	var maxID uint32
	for tok, id := range hm.Vocab {
		if id >= maxTokenID {
			return nil, nil, nil, fmt.Errorf("model: token %q has id %d (max %d)", tok, id, maxTokenID-1)
		}
		maxID = max(maxID, id)
	}
	table := make([][]byte, maxID+1)
	m := &bpeModel{merges: make(map[uint64]merge, len(hm.Merges))}
	for i := range m.byteID {
		m.byteID[i] = -1
	}
	if hm.IgnoreMerges {
		m.whole = make(map[string]uint32, len(hm.Vocab))
	}
	for tok, id := range hm.Vocab {
		b, ok := vocabBytes(tok)
		if !ok {
			return nil, nil, nil, unsupported("vocab token %q is not byte-level encoded", tok)
		}
		table[id] = b
		if len(b) == 1 {
			m.byteID[b[0]] = int32(id)
		}
		if m.whole != nil {
			m.whole[string(b)] = id
		}
	}
	if hm.UnkToken != nil {
		for b, id := range m.byteID {
			if id < 0 {
				return nil, nil, nil, unsupported("byte 0x%02x missing from vocab with unk_token set", b)
			}
		}
	}
	for rank, mg := range hm.Merges {
		a, okA := hm.Vocab[mg.a]
		b, okB := hm.Vocab[mg.b]
		ab, okAB := hm.Vocab[mg.a+mg.b]
		if !okA || !okB || !okAB {
			return nil, nil, nil, fmt.Errorf("model: merge %d (%q %q) uses a token missing from the vocab", rank, mg.a, mg.b)
		}
		// A later duplicate overwrites an earlier one, as in HF.
		m.merges[pairKey(a, b)] = merge{rank: uint32(rank), id: ab}
	}
	return m, table, hm.Vocab, nil
}
