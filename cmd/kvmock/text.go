package main

import (
	"github.com/kvrouter/kvrouter/api/tokenize"
	"github.com/kvrouter/kvrouter/internal/splitmix"
)

// Word ids of the builtin tokenizer (see tokenize.BuiltinVocabSize): ids
// from 384 up are words, which Decode spells as pronounceable canonical
// words and Encode maps back to the same ids.
const (
	builtinWordBase  = 384
	builtinWordCount = tokenize.BuiltinVocabSize - builtinWordBase
)

// outputIDs are n deterministic word ids for a prompt: the same seed and
// prompt always give the same answer.
func outputIDs(seed uint64, prompt []uint32, n int) []uint32 {
	h := splitmix.Next(seed)
	for _, t := range prompt {
		h = splitmix.Next(h ^ uint64(t))
	}
	ids := make([]uint32, n)
	for i := range ids {
		h = splitmix.Next(h)
		ids[i] = builtinWordBase + uint32(h%builtinWordCount)
	}
	return ids
}

// outputPieces spells word ids one token at a time; their concatenation is
// tok.Decode(ids) (Decode puts a space before every word but the first), so
// a streamed answer reads like the plain one, and re-encoding the text
// (e.g. in the next chat turn) gives the ids back.
func outputPieces(tok tokenize.Tokenizer, ids []uint32) []string {
	pieces := make([]string, len(ids))
	for i, id := range ids {
		pieces[i] = tok.Decode([]uint32{id})
		if i > 0 {
			pieces[i] = " " + pieces[i]
		}
	}
	return pieces
}
