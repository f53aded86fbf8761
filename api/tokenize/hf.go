package tokenize

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// HF is a BPE tokenizer read from a Hugging Face tokenizer.json: byte-level
// (Qwen, Llama 3, DeepSeek V3, gpt-oss, GPT-2) or SentencePiece-style
// with byte fallback (Llama 2, Gemma). Encoding follows the HF tokenizers
// pipeline step for step:
//
//  1. split out added tokens whose normalized flag is false (raw text);
//  2. normalise each remaining stretch, then split out added tokens whose
//     normalized flag is true;
//  3. pre-tokenise each remaining piece (pretok_pipeline.go);
//  4. BPE each pre-token (bpe.go);
//  5. for EncodeSpecial, let the post-processor add its special tokens.
//
// HF is immutable after loading except for its word cache, and safe for
// concurrent use.
type HF struct {
	name      string
	norm      normalizer    // nil: none
	added     *addedMatcher // matched on raw text
	addedNorm *addedMatcher // matched on normalised text
	pre       *preTokenizer
	model     *bpeModel
	post      *postProcessor
	dec       decoder // nil: tokens joined with spaces
	// tokens maps every id (model and added) to the string HF decodes it
	// from: the vocab spelling or the added token's content; known[id]
	// says whether the id exists.
	tokens []string
	known  []bool
	// decBytes (only when the decoder is exactly ByteLevel) holds each
	// id's bytes, so Decode of byte-level tokenizers builds no strings.
	decBytes [][]byte
	// vocab maps spellings to ids, model and added tokens.
	vocab map[string]uint32
	cache *wordCache
}

var _ Tokenizer = (*HF)(nil)

// LoadHF reads a tokenizer.json. path may also be the directory holding it
// (a Hugging Face model directory).
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

// ParseHF builds a tokenizer from the contents of a tokenizer.json (for
// callers that read the file themselves); name is what Name returns.
func ParseHF(data []byte, name string) (*HF, error) {
	h, err := parseHF(data, name)
	if err != nil {
		return nil, fmt.Errorf("tokenize: parse %s: %w", name, err)
	}
	return h, nil
}

// parseHF builds an HF from the contents of a tokenizer.json.
func parseHF(data []byte, name string) (*HF, error) {
	f, hm, err := readHFFile(data)
	if err != nil {
		return nil, err
	}
	h := &HF{name: name, cache: newWordCache(cacheEntries)}
	if h.norm, err = parseNormalizer(f.Normalizer); err != nil {
		return nil, err
	}
	if h.pre, err = parsePreTokenizer(f.PreTokenizer); err != nil {
		return nil, err
	}
	if h.post, err = parsePostProcessor(f.PostProcessor); err != nil {
		return nil, err
	}
	if h.dec, err = parseDecoder(f.Decoder); err != nil {
		return nil, err
	}
	if h.model, h.tokens, err = parseModel(hm, f.Model, h.pre.byteLevel); err != nil {
		return nil, err
	}
	if err := h.addTokens(f.AddedTokens); err != nil {
		return nil, err
	}
	for _, st := range h.post.steps {
		for _, id := range append(append([]uint32(nil), st.before...), st.after...) {
			if !h.has(id) {
				return nil, fmt.Errorf("post_processor: special token id %d not in the vocabulary", id)
			}
		}
	}
	if _, ok := h.dec.(decByteLevel); ok {
		h.decBytes = make([][]byte, len(h.tokens))
		for id, tok := range h.tokens {
			if h.known[id] {
				h.decBytes[id] = appendByteLevel(nil, tok)
			}
		}
	}
	return h, nil
}

// addTokens registers the added tokens, with their matchers and decode
// strings.
func (h *HF) addTokens(list []hfAddedToken) error {
	h.known = make([]bool, len(h.tokens))
	h.vocab = make(map[string]uint32, len(h.model.vocab)+len(list))
	for tok, id := range h.model.vocab {
		h.known[id] = true
		h.vocab[tok] = id
	}
	var raw, normalized []addedToken
	for i, at := range list {
		if at.ID == nil {
			return fmt.Errorf("added_tokens[%d] %q: missing id", i, at.Content)
		}
		id := *at.ID
		if id >= maxTokenID {
			return fmt.Errorf("added_tokens[%d] %q: id %d too large", i, at.Content, id)
		}
		if at.Content == "" {
			continue // HF ignores empty added tokens
		}
		t := addedToken{id: id, content: at.Content, lstrip: at.LStrip, rstrip: at.RStrip, singleWrd: at.SingleWord}
		// HF's default: special tokens are matched on raw text.
		isNorm := !at.Special
		if at.Normalized != nil {
			isNorm = *at.Normalized
		}
		if isNorm {
			// Matched against normalised text, so the content goes
			// through the whole normalizer too (with Prepend, "x" is
			// looked for as "▁x", as in HF).
			if h.norm != nil {
				t.content = h.norm.normalize(t.content)
			}
			if t.content != "" {
				normalized = append(normalized, t)
			}
		} else {
			raw = append(raw, t)
		}
		for int(id) >= len(h.tokens) {
			h.tokens = append(h.tokens, "")
			h.known = append(h.known, false)
		}
		h.tokens[id] = at.Content
		h.known[id] = true
		h.vocab[at.Content] = id
	}
	h.added = newAddedMatcher(raw)
	h.addedNorm = newAddedMatcher(normalized)
	return nil
}

func (h *HF) has(id uint32) bool { return int(id) < len(h.known) && h.known[id] }

// Name returns "hf:" and the name of the directory holding tokenizer.json
// (or the name given to ParseHF).
func (h *HF) Name() string { return h.name }

// VocabSize returns one more than the largest id (model or added token).
func (h *HF) VocabSize() int { return len(h.tokens) }

// TokenID returns the id of a token in its tokenizer.json spelling: the
// vocab form for model tokens ("Ġworld" for " world" in byte-level
// vocabularies, "▁world" in SentencePiece ones), the content for added
// tokens ("<|im_end|>").
func (h *HF) TokenID(token string) (uint32, bool) {
	id, ok := h.vocab[token]
	return id, ok
}

// Encode implements Tokenizer (add_special_tokens=false).
func (h *HF) Encode(text string) []uint32 {
	text = sanitizeUTF8(text)
	ids := make([]uint32, 0, len(text)/3+4)
	var subs []segment // reused across segments
	var pieces, scratch []piece
	pos := 0 // offset of seg in text
	for _, seg := range h.added.split(nil, text) {
		first := pos == 0
		pos += len(seg.text)
		if seg.added {
			ids = append(ids, seg.id)
			continue
		}
		s := seg.text
		if h.norm != nil {
			s = h.norm.normalize(s)
		}
		subs = h.addedNorm.split(subs[:0], s)
		for i, sub := range subs {
			if sub.added {
				ids = append(ids, sub.id)
				continue
			}
			if h.pre.stream != nil {
				ids = h.encodeStream(ids, sub.text)
				continue
			}
			pieces, scratch = h.pre.run(pieces[:0], scratch, sub.text, first && i == 0)
			for _, p := range pieces {
				ids = h.encodeWord(ids, p.text)
			}
		}
	}
	return ids
}

// EncodeSpecial implements Tokenizer (add_special_tokens=true): Encode,
// then what the post-processor adds for a single sequence.
func (h *HF) EncodeSpecial(text string) []uint32 {
	return h.post.apply(h.Encode(text))
}

// encodeStream pre-tokenises with the stream scanner and BPEs each piece.
func (h *HF) encodeStream(ids []uint32, s string) []uint32 {
	if h.pre.prefixSpace && s[0] != ' ' {
		s = " " + s
	}
	for len(s) > 0 {
		n := h.pre.stream.next(s)
		ids = h.encodeWord(ids, s[:n])
		s = s[n:]
	}
	return ids
}

// encodeWord BPEs one pre-token through the word cache.
func (h *HF) encodeWord(ids []uint32, w string) []uint32 {
	if cached, ok := h.cache.get(w); ok {
		return append(ids, cached...)
	}
	k := len(ids)
	ids = h.model.encodeWord(ids, w)
	if len(w) > 1 {
		h.cache.put(w, append([]uint32(nil), ids[k:]...))
	}
	return ids
}

// Decode implements Tokenizer like HF's decode with
// skip_special_tokens=false: unknown ids are skipped, the rest go through
// the decoder chain.
func (h *HF) Decode(ids []uint32) string {
	if h.decBytes != nil {
		var buf []byte
		for _, id := range ids {
			if h.has(id) {
				buf = append(buf, h.decBytes[id]...)
			}
		}
		return lossyUTF8(buf)
	}
	toks := make([]string, 0, len(ids))
	for _, id := range ids {
		if h.has(id) {
			toks = append(toks, h.tokens[id])
		}
	}
	if h.dec == nil {
		return strings.Join(toks, " ")
	}
	return strings.Join(h.dec.decodeChain(toks), "")
}
