package tokenize

import (
	"strings"
	"unicode"
	"unicode/utf8"
)

// The builtin tokenizer needs no files, so kvmock and the router agree on
// ids out of the box (tests, demos, a router in front of mock workers). It is
// not a real language-model tokenizer; what matters is that it is
// deterministic across processes, versions and machines, so its ids and
// layout below are a compatibility contract: changing them changes every
// block hash kvmock reports.
//
// Id layout (BuiltinVocabSize ids):
//
//	0..2        special tokens <|endoftext|>, <|im_start|>, <|im_end|>
//	3..255      reserved for future specials, never produced
//	256..383    one ASCII character each (256 + byte); Encode produces them
//	            for ASCII punctuation/symbols and for '\n'
//	384..31999  words: FNV-1a 32 of the word's UTF-8, mod 31616, plus 384
//
// A word is a maximal run of runes that are neither whitespace nor
// punctuation/symbols; non-ASCII punctuation and symbols are one-rune words.
// Whitespace other than '\n' only separates words, so "a  b" and "a b" have
// the same ids. '\n' is kept because it delimits chat turns.
//
// Hashes cannot be inverted, so Decode spells each word id as a
// pronounceable "canonical" word (three consonant-vowel syllables, e.g.
// "bakemo"), and Encode maps canonical words back to their id without
// hashing. Hence Encode(Decode(ids)) == ids for any ids Encode can produce,
// which lets kvmock feed generated text back into a multi-turn prompt and
// get the same ids, as a real engine would.
const (
	BuiltinVocabSize = 32000

	builtinASCIIBase = 256
	builtinWordBase  = 384
	builtinWordCount = BuiltinVocabSize - builtinWordBase
)

// builtinSpecials are the builtin special tokens, id = index. They use the
// ChatML spellings so that ChatML-rendered prompts also work.
var builtinSpecials = [...]string{"<|endoftext|>", "<|im_start|>", "<|im_end|>"}

const (
	syllableConsonants = "bdfgklmnprstvz"
	syllableVowels     = "aeiou"
	// syllables = len(syllableConsonants) * len(syllableVowels), untyped;
	// 70^3 >= builtinWordCount, so three syllables spell every word id.
	syllables = 70
)

type builtin struct {
	specials *addedMatcher
}

// Builtin returns the zero-configuration tokenizer (see the id layout
// above). It is stateless and safe for concurrent use.
func Builtin() Tokenizer {
	toks := make([]addedToken, len(builtinSpecials))
	for i, s := range builtinSpecials {
		toks[i] = addedToken{id: uint32(i), content: s}
	}
	return builtin{specials: newAddedMatcher(toks)}
}

func (builtin) Name() string { return "builtin" }

func (t builtin) Encode(text string) []uint32 {
	// About one id per word and its space: one allocation for most prompts.
	return t.AppendEncode(make([]uint32, 0, len(text)/4+4), text)
}

// AppendEncode appends Encode(text) to ids (Splitter).
func (t builtin) AppendEncode(ids []uint32, text string) []uint32 {
	text = sanitizeUTF8(text)
	for _, seg := range t.specials.split(nil, text) {
		if seg.added {
			ids = append(ids, seg.id)
			continue
		}
		s := seg.text
		for len(s) > 0 {
			var class byte
			w := 1
			if c := s[0]; c < utf8.RuneSelf {
				class = builtinASCIIClass[c]
			} else {
				var r rune
				r, w = utf8.DecodeRuneInString(s)
				class = builtinClassOf(r)
			}
			switch class {
			case builtinNewline:
				ids = append(ids, builtinASCIIBase+'\n')
			case builtinSpace:
			case builtinPunct:
				if w == 1 {
					ids = append(ids, builtinASCIIBase+uint32(s[0]))
				} else {
					ids = append(ids, builtinWordID(s[:w]))
				}
			default:
				w = builtinWordLen(s)
				ids = append(ids, builtinWordID(s[:w]))
			}
			s = s[w:]
		}
	}
	return ids
}

// Rune classes of the builtin tokenizer: a word rune, '\n', other
// whitespace (separates words), punctuation or symbol (a token of its own).
const (
	builtinWord byte = iota
	builtinNewline
	builtinSpace
	builtinPunct
)

// builtinClassOf is the class of r, by Unicode's tables (the contract).
func builtinClassOf(r rune) byte {
	switch {
	case r == '\n':
		return builtinNewline
	case unicode.IsSpace(r):
		return builtinSpace
	case unicode.IsPunct(r) || unicode.IsSymbol(r):
		return builtinPunct
	}
	return builtinWord
}

// builtinASCIIClass is builtinClassOf for ASCII, looked up instead of
// asking Unicode's tables for every byte of a prompt.
var builtinASCIIClass = func() (t [utf8.RuneSelf]byte) {
	for c := range t {
		t[c] = builtinClassOf(rune(c))
	}
	return t
}()

// builtinWordLen is the length of the word s starts with: its runes up to
// the first whitespace, punctuation or symbol.
func builtinWordLen(s string) int {
	w := 0
	for w < len(s) {
		if c := s[w]; c < utf8.RuneSelf {
			if builtinASCIIClass[c] != builtinWord {
				break
			}
			w++
			continue
		}
		r, rw := utf8.DecodeRuneInString(s[w:])
		if builtinClassOf(r) != builtinWord {
			break
		}
		w += rw
	}
	return w
}

// Cut is the length of head up to and including its last ASCII whitespace
// byte, 0 when it has none (Splitter). Whitespace ends any word, is no part
// of a special token, and an ASCII byte is a whole rune whatever comes
// before it, so the ids of any text cut after it are the ids of the two
// pieces: nothing after the cut can change a token before it
// (FuzzBuiltinCut).
func (builtin) Cut(head string) int {
	for i := len(head) - 1; i >= 0; i-- {
		if c := head[i]; c < utf8.RuneSelf {
			if k := builtinASCIIClass[c]; k == builtinSpace || k == builtinNewline {
				return i + 1
			}
		}
	}
	return 0
}

// EncodeSpecial is Encode: the builtin tokenizer adds no BOS/EOS.
func (t builtin) EncodeSpecial(text string) []uint32 { return t.Encode(text) }

// builtinWordID maps a word to its id: canonical spellings decode directly,
// anything else is hashed.
func builtinWordID(word string) uint32 {
	if idx, ok := parseCanonical(word); ok {
		return builtinWordBase + idx
	}
	// FNV-1a 32 (hash/fnv's), inline: no hasher to allocate per word.
	const offset32, prime32 = 2166136261, 16777619
	h := uint32(offset32)
	for i := 0; i < len(word); i++ {
		h ^= uint32(word[i])
		h *= prime32
	}
	return builtinWordBase + h%builtinWordCount
}

// canonicalWord spells word index idx (0 <= idx < builtinWordCount).
func canonicalWord(idx uint32) string {
	var b [6]byte
	for i := 2; i >= 0; i-- {
		syl := idx % syllables
		idx /= syllables
		b[2*i] = syllableConsonants[syl/uint32(len(syllableVowels))]
		b[2*i+1] = syllableVowels[syl%uint32(len(syllableVowels))]
	}
	return string(b[:])
}

func parseCanonical(word string) (uint32, bool) {
	if len(word) != 6 {
		return 0, false
	}
	var idx uint32
	for i := 0; i < 6; i += 2 {
		c, v := syllableConsonantIndex[word[i]], syllableVowelIndex[word[i+1]]
		if c < 0 || v < 0 {
			return 0, false
		}
		idx = idx*syllables + uint32(int(c)*len(syllableVowels)+int(v))
	}
	return idx, idx < builtinWordCount
}

// syllableConsonantIndex and syllableVowelIndex are the positions of each
// byte in syllableConsonants and syllableVowels, -1 for the others.
var syllableConsonantIndex, syllableVowelIndex = letterIndex(syllableConsonants), letterIndex(syllableVowels)

func letterIndex(letters string) (t [256]int8) {
	for i := range t {
		t[i] = int8(strings.IndexByte(letters, byte(i)))
	}
	return t
}

// Decode renders specials and ASCII ids as themselves and word ids as their
// canonical spelling, with a space before each word unless it starts the
// text or a line. Reserved and out-of-range ids are skipped.
func (builtin) Decode(ids []uint32) string {
	var b strings.Builder
	for _, id := range ids {
		switch {
		case int(id) < len(builtinSpecials):
			b.WriteString(builtinSpecials[id])
		case id < builtinASCIIBase:
		case id < builtinWordBase:
			b.WriteByte(byte(id - builtinASCIIBase))
		case id < BuiltinVocabSize:
			if s := b.String(); s != "" && s[len(s)-1] != '\n' {
				b.WriteByte(' ')
			}
			b.WriteString(canonicalWord(id - builtinWordBase))
		}
	}
	return b.String()
}
