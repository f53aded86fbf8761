package tokenize

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
)

// This file holds the JSON shapes of tokenizer.json. The load_*.go files
// turn each component into its Go form. They accept only the components
// whose behaviour this package reproduces exactly and reject the rest with
// ErrUnsupported: a tokenizer that loads but disagrees with the worker would
// silently break prefix-cache routing, which is worse than failing to start.

// ErrUnsupported wraps load errors for tokenizer.json features this package
// does not implement (as opposed to malformed files). Callers may fall back
// to Builtin on it.
var ErrUnsupported = errors.New("unsupported tokenizer feature")

// maxTokenID bounds ids so a corrupt file cannot make us allocate a huge
// id -> token table. Real vocabularies are well under a million (Gemma's
// 262k is among the largest).
const maxTokenID = 1 << 21

type hfFile struct {
	AddedTokens   []hfAddedToken  `json:"added_tokens"`
	Normalizer    json.RawMessage `json:"normalizer"`
	PreTokenizer  json.RawMessage `json:"pre_tokenizer"`
	PostProcessor json.RawMessage `json:"post_processor"`
	Decoder       json.RawMessage `json:"decoder"`
	Model         json.RawMessage `json:"model"`
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

// hfPattern is a Split, Replace or decoder pattern: exactly one of String
// and Regex.
type hfPattern struct {
	Regex  *string `json:"Regex"`
	String *string `json:"String"`
}

// hfComponent covers the fields of every normalizer, pre-tokenizer,
// post-processor and decoder variant we accept; "type" selects the
// variant.
type hfComponent struct {
	Type string `json:"type"`
	// Sequences.
	Normalizers   []json.RawMessage `json:"normalizers"`
	PreTokenizers []json.RawMessage `json:"pretokenizers"`
	Processors    []json.RawMessage `json:"processors"`
	Decoders      []json.RawMessage `json:"decoders"`
	// ByteLevel.
	AddPrefixSpace *bool `json:"add_prefix_space"`
	UseRegex       *bool `json:"use_regex"`
	// Split, Replace.
	Pattern  hfPattern `json:"pattern"`
	Behavior string    `json:"behavior"`
	Invert   bool      `json:"invert"`
	Content  *string   `json:"content"` // Replace; Strip (a one-rune string)
	// Prepend.
	Prepend *string `json:"prepend"`
	// Digits.
	IndividualDigits bool `json:"individual_digits"`
	// Metaspace.
	Replacement   *string `json:"replacement"`
	PrependScheme *string `json:"prepend_scheme"`
	Split         *bool   `json:"split"`
	// Strip decoder.
	Start int `json:"start"`
	Stop  int `json:"stop"`
	// TemplateProcessing.
	Single        []hfTemplatePiece         `json:"single"`
	SpecialTokens map[string]hfSpecialToken `json:"special_tokens"`
	// BertProcessing, RobertaProcessing: [token, id].
	Sep []json.RawMessage `json:"sep"`
	Cls []json.RawMessage `json:"cls"`
}

type hfTemplatePiece struct {
	SpecialToken *struct {
		ID string `json:"id"`
	} `json:"SpecialToken"`
	Sequence *struct {
		ID string `json:"id"`
	} `json:"Sequence"`
}

type hfSpecialToken struct {
	IDs []uint32 `json:"ids"`
}

type hfModel struct {
	Type                    string   `json:"type"`
	Dropout                 *float64 `json:"dropout"`
	UnkToken                *string  `json:"unk_token"`
	ContinuingSubwordPrefix *string  `json:"continuing_subword_prefix"`
	EndOfWordSuffix         *string  `json:"end_of_word_suffix"`
	FuseUnk                 bool     `json:"fuse_unk"`
	ByteFallback            bool     `json:"byte_fallback"`
	IgnoreMerges            bool     `json:"ignore_merges"`
	// Vocab and Merges are read by readModel, not encoding/json.
	Vocab  map[string]uint32 `json:"-"`
	Merges []hfMerge         `json:"-"`
	// present: the file had a model object.
	present bool
}

// hfMerge is one merge: the legacy "a b" string or the newer ["a", "b"]
// pair (which allows spaces inside tokens); see readMerge.
type hfMerge struct{ a, b string }

func isNull(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) == 0 || bytes.Equal(raw, []byte("null"))
}

func unsupported(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrUnsupported, fmt.Sprintf(format, args...))
}

// component decodes one normalizer, pre-tokenizer, post-processor or
// decoder; what names the kind for errors.
func component(raw json.RawMessage, what string) (hfComponent, error) {
	var c hfComponent
	if err := json.Unmarshal(raw, &c); err != nil {
		return c, fmt.Errorf("%s: %w", what, err)
	}
	return c, nil
}

// patternMatcher compiles a Split or Replace pattern.
func patternMatcher(p hfPattern) (m matcher, literal string, err error) {
	switch {
	case p.String != nil && p.Regex != nil:
		return nil, "", errors.New("pattern has both String and Regex")
	case p.String != nil:
		if *p.String == "" {
			return nil, "", unsupported("empty String pattern")
		}
		return literalMatcher(*p.String), *p.String, nil
	case p.Regex != nil:
		m, err := compileRegex(*p.Regex)
		return m, "", err
	}
	return nil, "", errors.New("pattern has neither String nor Regex")
}
