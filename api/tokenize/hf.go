package tokenize

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/text/unicode/norm"
)

// HF is a byte-level BPE tokenizer read from a Hugging Face tokenizer.json.
// Encoding follows the HF tokenizers pipeline step for step:
//
//  1. split out added tokens whose normalized flag is false (raw text);
//  2. NFC-normalise the remaining text, if the file declares NFC, then
//     split out added tokens whose normalized flag is true;
//  3. pre-tokenise each piece with the file's Split regex (hand-written
//     scanner, see pretokenize.go);
//  4. BPE each pre-token over its UTF-8 bytes.
//
// HF is immutable after loading except for its word cache, and safe for
// concurrent use.
type HF struct {
	name      string
	nfc       bool
	added     *addedMatcher // matched on raw text
	addedNorm *addedMatcher // matched on normalised text
	pre       preTok
	model     *bpeModel
	// decode maps every id (model and added) to the bytes it decodes to;
	// nil for ids that do not exist.
	decode [][]byte
	// vocab maps byte-level spellings to ids, model and added tokens.
	vocab map[string]uint32
	cache *wordCache
}

var _ Tokenizer = (*HF)(nil)

// LoadHF reads a tokenizer.json. path may also be the directory holding it.
func LoadHF(path string) (*HF, error) {
	if fi, err := os.Stat(path); err == nil && fi.IsDir() {
		path = filepath.Join(path, "tokenizer.json")
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("tokenize: load %s: %w", path, err)
	}
	dir := filepath.Dir(path)
	if abs, err := filepath.Abs(path); err == nil {
		dir = filepath.Dir(abs) // "tokenizer.json" alone names its directory, not "."
	}
	h, err := parseHF(data, "hf:"+filepath.Base(dir))
	if err != nil {
		return nil, fmt.Errorf("tokenize: load %s: %w", path, err)
	}
	return h, nil
}

// parseHF builds an HF from the contents of a tokenizer.json.
func parseHF(data []byte, name string) (*HF, error) {
	var f hfFile
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, fmt.Errorf("parse json: %w", err)
	}
	nfc, err := parseNormalizer(f.Normalizer)
	if err != nil {
		return nil, err
	}
	pre, err := parsePreTokenizer(f.PreTokenizer)
	if err != nil {
		return nil, err
	}
	if err := parseDecoder(f.Decoder); err != nil {
		return nil, err
	}
	model, table, vocab, err := parseModel(f.Model)
	if err != nil {
		return nil, err
	}
	h := &HF{name: name, nfc: nfc, pre: pre, model: model, vocab: vocab, cache: newWordCache(cacheEntries)}

	var raw, normalized []addedToken
	for i, at := range f.AddedTokens {
		if at.ID == nil {
			return nil, fmt.Errorf("added_tokens[%d] %q: missing id", i, at.Content)
		}
		if *at.ID >= maxTokenID {
			return nil, fmt.Errorf("added_tokens[%d] %q: id %d too large", i, at.Content, *at.ID)
		}
		if at.Content == "" {
			continue // HF ignores empty added tokens
		}
		t := addedToken{id: *at.ID, content: at.Content, lstrip: at.LStrip, rstrip: at.RStrip, singleWrd: at.SingleWord}
		// HF's default: special tokens are matched on raw text.
		isNorm := !at.Special
		if at.Normalized != nil {
			isNorm = *at.Normalized
		}
		if isNorm {
			// Normalised tokens are matched against normalised text, so
			// their content is normalised too.
			if nfc {
				t.content = norm.NFC.String(t.content)
			}
			normalized = append(normalized, t)
		} else {
			raw = append(raw, t)
		}
		for int(t.id) >= len(table) {
			table = append(table, nil)
		}
		// Decoding uses the normalised form for normalised tokens, as
		// current HF does.
		table[t.id] = addedDecodeBytes(t.content)
	}
	h.added = newAddedMatcher(raw)
	h.addedNorm = newAddedMatcher(normalized)
	h.decode = table
	for _, at := range f.AddedTokens {
		if at.Content != "" {
			h.vocab[at.Content] = *at.ID
		}
	}
	return h, nil
}

// addedDecodeBytes mirrors the HF ByteLevel decoder on an added token: the
// token's text goes through the byte-level mapping if every rune is a
// byte-level rune, otherwise its UTF-8 is used as is. For "<|im_end|>"
// both give the same bytes; for an added token "é" (itself the byte-level
// rune of byte 0xE9) HF decodes the lone byte 0xE9, i.e. U+FFFD, and so
// do we.
func addedDecodeBytes(content string) []byte {
	if b, ok := vocabBytes(content); ok {
		return b
	}
	return []byte(content)
}

// Name returns "hf:" and the name of the directory holding tokenizer.json.
func (h *HF) Name() string { return h.name }

// VocabSize returns one more than the largest id (model or added token).
func (h *HF) VocabSize() int { return len(h.decode) }

// TokenID returns the id of a token in its tokenizer.json spelling: the
// byte-level form for vocabulary entries ("Ġworld" for " world"), the
// content for added tokens ("<|im_end|>").
func (h *HF) TokenID(token string) (uint32, bool) {
	id, ok := h.vocab[token]
	return id, ok
}

// Encode implements Tokenizer.
func (h *HF) Encode(text string) []uint32 {
	text = sanitizeUTF8(text)
	ids := make([]uint32, 0, len(text)/3+4)
	var subs []segment // reused across segments
	for _, seg := range h.added.split(nil, text) {
		if seg.added {
			ids = append(ids, seg.id)
			continue
		}
		s := seg.text
		if h.nfc {
			s = norm.NFC.String(s)
		}
		subs = h.addedNorm.split(subs[:0], s)
		for _, sub := range subs {
			if sub.added {
				ids = append(ids, sub.id)
				continue
			}
			ids = h.encodePlain(ids, sub.text)
		}
	}
	return ids
}

// encodePlain pre-tokenises and BPEs text that contains no added tokens.
func (h *HF) encodePlain(ids []uint32, s string) []uint32 {
	if h.pre.prefixSpace && s[0] != ' ' {
		s = " " + s
	}
	for len(s) > 0 {
		n := h.pre.split.next(s)
		w := s[:n]
		s = s[n:]
		if cached, ok := h.cache.get(w); ok {
			ids = append(ids, cached...)
			continue
		}
		k := len(ids)
		ids = h.model.encodeWord(ids, w)
		if len(w) > 1 {
			h.cache.put(w, append([]uint32(nil), ids[k:]...))
		}
	}
	return ids
}

// Decode implements Tokenizer: the bytes of every known id, concatenated,
// with ill-formed UTF-8 (e.g. a character cut between two ids) replaced by
// U+FFFD as HF does. Special tokens are kept; unknown ids are skipped.
func (h *HF) Decode(ids []uint32) string {
	var buf []byte
	for _, id := range ids {
		if int(id) < len(h.decode) {
			buf = append(buf, h.decode[id]...)
		}
	}
	return lossyUTF8(buf)
}
