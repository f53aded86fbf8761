package tokenize

import (
	"encoding/json"
	"errors"
	"fmt"
	"unicode/utf8"
)

// parseModel builds the BPE model and the id -> token table of the model
// vocabulary. byteLevel says whether a ByteLevel pre-tokenizer feeds the
// model (see bpeModel).
// hm is the model as readModel read it; raw is set instead when the
// model value was not an object.
func parseModel(hm hfModel, raw json.RawMessage, byteLevel bool) (*bpeModel, []string, error) {
	if !hm.present {
		if isNull(raw) {
			return nil, nil, errors.New("missing model")
		}
		return nil, nil, fmt.Errorf("model: want an object, got %.20s", raw)
	}
	switch {
	case hm.Type != "BPE" && hm.Type != "":
		return nil, nil, unsupported("model type %q (only BPE)", hm.Type)
	case hm.Dropout != nil && *hm.Dropout != 0:
		return nil, nil, unsupported("BPE dropout (non-deterministic)")
	case len(hm.Vocab) == 0:
		return nil, nil, errors.New("model: empty vocab")
	}

	var maxID uint32
	for tok, id := range hm.Vocab {
		if id >= maxTokenID {
			return nil, nil, fmt.Errorf("model: token %q has id %d (max %d)", tok, id, maxTokenID-1)
		}
		maxID = max(maxID, id)
	}
	table := make([]string, maxID+1)
	for tok, id := range hm.Vocab {
		table[id] = tok
	}
	m := &bpeModel{
		byteLevel:    byteLevel,
		vocab:        hm.Vocab,
		byteFallback: hm.ByteFallback,
		fuseUnk:      hm.FuseUnk,
		unk:          -1,
		merges:       make(map[uint64]merge, len(hm.Merges)),
	}
	if hm.ContinuingSubwordPrefix != nil {
		m.prefix = *hm.ContinuingSubwordPrefix
	}
	if hm.EndOfWordSuffix != nil {
		m.suffix = *hm.EndOfWordSuffix
	}
	if hm.UnkToken != nil {
		id, ok := hm.Vocab[*hm.UnkToken]
		if !ok {
			// HF fails the encode call when it needs the unk; we cannot
			// return an error from Encode.
			return nil, nil, unsupported("unk_token %q missing from the vocab", *hm.UnkToken)
		}
		m.unk = int32(id)
	}
	for b := range 256 {
		m.fallback[b] = lookup(hm.Vocab, fmt.Sprintf("<0x%02X>", b))
		m.byteID[b] = lookup(hm.Vocab, string(byteRunes[b]))
	}
	if !byteLevel {
		m.runeID = make(map[rune]uint32)
		for tok, id := range hm.Vocab {
			// U+FFFD counts: "\ufffd" is in SentencePiece vocabularies.
			// The empty token is no rune (DecodeRuneInString reports it as
			// U+FFFD of width 0).
			if r, w := utf8.DecodeRuneInString(tok); w > 0 && w == len(tok) && utf8.ValidString(tok) {
				m.runeID[r] = id
			}
		}
	}
	if hm.IgnoreMerges {
		m.whole = make(map[string]uint32, len(hm.Vocab))
		for tok, id := range hm.Vocab {
			if !byteLevel {
				m.whole[tok] = id
			} else if b, ok := vocabBytes(tok); ok {
				// Entries that are not byte-level spellings can never equal
				// a byte-level word.
				m.whole[string(b)] = id
			}
		}
	}
	for rank, mg := range hm.Merges {
		// HF forms the merged token by dropping prefix-length bytes from
		// b, whether or not b starts with the prefix.
		if len(mg.b) < len(m.prefix) || (len(mg.b) > len(m.prefix) && !utf8.RuneStart(mg.b[len(m.prefix)])) {
			return nil, nil, fmt.Errorf("model: merge %d (%q %q) shorter than continuing_subword_prefix", rank, mg.a, mg.b)
		}
		merged := mg.a + mg.b[len(m.prefix):]
		a, okA := hm.Vocab[mg.a]
		b, okB := hm.Vocab[mg.b]
		ab, okAB := hm.Vocab[merged]
		if !okA || !okB || !okAB {
			return nil, nil, fmt.Errorf("model: merge %d (%q %q) uses a token missing from the vocab", rank, mg.a, mg.b)
		}
		// A later duplicate overwrites an earlier one, as in HF.
		m.merges[pairKey(a, b)] = merge{rank: uint32(rank), id: ab}
	}
	return m, table, nil
}

func lookup(vocab map[string]uint32, tok string) int32 {
	if id, ok := vocab[tok]; ok {
		return int32(id)
	}
	return -1
}
