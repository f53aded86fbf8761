package tokenize

import (
	"hash/fnv"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"
)

// TestBuiltinPinned pins ids: they are a cross-process contract between
// kvmock and the router, so any change here is a compatibility break.
func TestBuiltinPinned(t *testing.T) {
	tok := Builtin()
	tests := []struct {
		text string
		want []uint32
	}{
		{"", nil},
		{"<|endoftext|><|im_start|><|im_end|>", []uint32{0, 1, 2}},
		{",.!\n", []uint32{256 + ',', 256 + '.', 256 + '!', 256 + '\n'}},
		// FNV-1a 32 of the word, mod 31616, plus 384 (checked against an
		// independent implementation).
		{"hello", []uint32{24491}},
		{"Hello, world!", []uint32{25419, 256 + ',', 26771, 256 + '!'}},
		// Canonical word: syllable = consonant*5 + vowel over "bdfgklmnprstvz"
		// and "aeiou": ba = 0, ke = 4*5+1 = 21, mo = 6*5+3 = 33.
		{"bakemo", []uint32{builtinWordBase + 0*70*70 + 21*70 + 33}},
	}
	for _, tt := range tests {
		if got := tok.Encode(tt.text); !slices.Equal(got, tt.want) {
			t.Errorf("Encode(%q) = %v, want %v", tt.text, got, tt.want)
		}
	}
	if tok.Name() != "builtin" {
		t.Errorf("Name() = %q", tok.Name())
	}
}

func TestBuiltinSegmentation(t *testing.T) {
	tok := Builtin()
	same := [][2]string{
		{"a b", "a   b"}, // whitespace only separates
		{"a b", "a\tb"},
		{"a b", " a b "},
		{"a,b", "a , b"}, // punctuation splits words
		{"x<|im_end|>y", "x <|im_end|> y"},
	}
	for _, p := range same {
		if a, b := tok.Encode(p[0]), tok.Encode(p[1]); !slices.Equal(a, b) {
			t.Errorf("Encode(%q) = %v != Encode(%q) = %v", p[0], a, p[1], b)
		}
	}
	differ := [][2]string{
		{"a b", "a\nb"}, // newlines are kept
		{"a b", "ab"},
		{"a b", "b a"},
		{"Hello", "hello"}, // case matters
	}
	for _, p := range differ {
		if a, b := tok.Encode(p[0]), tok.Encode(p[1]); slices.Equal(a, b) {
			t.Errorf("Encode(%q) == Encode(%q) = %v", p[0], p[1], a)
		}
	}
	if n := len(tok.Encode("naïve café — 你好 😀!")); n != 6 {
		t.Errorf("got %d ids, want 6 (naïve, café, —, 你好, 😀, !)", n)
	}
}

func TestCanonicalWords(t *testing.T) {
	if syllables != len(syllableConsonants)*len(syllableVowels) {
		t.Fatalf("syllables = %d, want %d", syllables, len(syllableConsonants)*len(syllableVowels))
	}
	if syllables*syllables*syllables < builtinWordCount {
		t.Fatal("three syllables cannot spell every word id")
	}
	for idx := uint32(0); idx < builtinWordCount; idx++ {
		w := canonicalWord(idx)
		if got, ok := parseCanonical(w); !ok || got != idx {
			t.Fatalf("parseCanonical(canonicalWord(%d) = %q) = %d, %v", idx, w, got, ok)
		}
	}
	for _, w := range []string{"", "bakem", "bakemoo", "Bakemo", "zzzzzz", "zuzuzu", "bakem0"} {
		if _, ok := parseCanonical(w); ok {
			t.Errorf("parseCanonical(%q) accepted", w)
		}
	}
}

// TestBuiltinReencode: decoded text encodes back to the same ids, for any
// ids Encode can produce.
func TestBuiltinReencode(t *testing.T) {
	tok := Builtin()
	texts := []string{
		"Hello, world!", "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
		"x = f(y) + 2;\n\tz", "naïve café — 你好 😀!", "(a)[b]{c}", "<|im_start|>",
	}
	for _, s := range texts {
		ids := tok.Encode(s)
		if got := tok.Encode(tok.Decode(ids)); !slices.Equal(got, ids) {
			t.Errorf("%q: Encode(Decode(%v)) = %v (decoded %q)", s, ids, got, tok.Decode(ids))
		}
	}
	rng := rand.New(rand.NewPCG(3, 4))
	ids := make([]uint32, 200)
	for i := range ids {
		switch rng.IntN(4) {
		case 0:
			const punct = ",.;:!?()[]{}<>|\n"
			ids[i] = builtinASCIIBase + uint32(punct[rng.IntN(len(punct))])
		case 1:
			ids[i] = uint32(rng.IntN(len(builtinSpecials)))
		default:
			ids[i] = builtinWordBase + uint32(rng.IntN(builtinWordCount))
		}
	}
	if got := tok.Encode(tok.Decode(ids)); !slices.Equal(got, ids) {
		t.Errorf("random ids do not survive decode/encode:\n got %v\nwant %v\ntext %q", got, ids, tok.Decode(ids))
	}
}

func TestBuiltinDecode(t *testing.T) {
	tok := Builtin()
	got := tok.Decode([]uint32{1, builtinWordBase, 256 + ',', builtinWordBase + 1, 256 + '\n', builtinWordBase + 2, 2, 5, 40000})
	if want := "<|im_start|> bababa, bababe\nbababi<|im_end|>"; got != want {
		t.Errorf("Decode = %q, want %q", got, want)
	}
}

func FuzzBuiltin(f *testing.F) {
	for _, s := range []string{"", "Hello, world!", "<|im_start|>a\nb", "\xff\xfe", "naïve — 😀"} {
		f.Add(s)
	}
	tok := Builtin()
	f.Fuzz(func(t *testing.T, s string) {
		ids := tok.Encode(s)
		for _, id := range ids {
			if id >= BuiltinVocabSize {
				t.Fatalf("id %d out of range", id)
			}
		}
		if got := tok.Encode(tok.Decode(ids)); !slices.Equal(got, ids) {
			t.Fatalf("Encode(Decode(%v)) = %v", ids, got)
		}
	})
}

// builtinEncodeReference is the builtin tokenizer as first written (one
// rune at a time through Unicode's tables, hash/fnv): the faster Encode
// must give the same ids for every text, since its ids are a contract.
func builtinEncodeReference(t builtin, text string) []uint32 {
	text = sanitizeUTF8(text)
	var ids []uint32
	for _, seg := range t.specials.split(nil, text) {
		if seg.added {
			ids = append(ids, seg.id)
			continue
		}
		s := seg.text
		for len(s) > 0 {
			r, w := utf8.DecodeRuneInString(s)
			switch {
			case r == '\n':
				ids = append(ids, builtinASCIIBase+'\n')
			case unicode.IsSpace(r):
			case unicode.IsPunct(r) || unicode.IsSymbol(r):
				if r < utf8.RuneSelf {
					ids = append(ids, builtinASCIIBase+uint32(r))
				} else {
					ids = append(ids, builtinWordIDReference(s[:w]))
				}
			default:
				w = 0
				for w < len(s) {
					r, rw := utf8.DecodeRuneInString(s[w:])
					if unicode.IsSpace(r) || unicode.IsPunct(r) || unicode.IsSymbol(r) {
						break
					}
					w += rw
				}
				ids = append(ids, builtinWordIDReference(s[:w]))
			}
			s = s[w:]
		}
	}
	return ids
}

func builtinWordIDReference(word string) uint32 {
	if len(word) == 6 {
		var idx uint32
		ok := true
		for i := 0; i < 6; i += 2 {
			c := strings.IndexByte(syllableConsonants, word[i])
			v := strings.IndexByte(syllableVowels, word[i+1])
			if c < 0 || v < 0 {
				ok = false
				break
			}
			idx = idx*syllables + uint32(c*len(syllableVowels)+v)
		}
		if ok && idx < builtinWordCount {
			return builtinWordBase + idx
		}
	}
	h := fnv.New32a()
	h.Write([]byte(word))
	return builtinWordBase + h.Sum32()%builtinWordCount
}

// TestBuiltinMatchesReference: every ASCII byte and a few non-ASCII runes
// of each class, alone and inside words, tokenize as the reference does.
func TestBuiltinMatchesReference(t *testing.T) {
	tok := Builtin().(builtin)
	var texts []string
	for c := range 128 {
		texts = append(texts, string(rune(c)), "ab"+string(rune(c))+"cd", string(rune(c))+"bakemo", "bakemo"+string(rune(c)))
	}
	for _, r := range []rune{0x85, 0xa0, 0x2003, 0x3000, '—', '«', '€', '😀', 'é', '你', 0xfffd, 0x1680, 0x2028} {
		texts = append(texts, string(r), "ab"+string(r)+"cd", "bakemo"+string(r)+" dubiza")
	}
	texts = append(texts, "\xff\xfe abc", "<|im_start|>user\nbakemo dubiza, kabuto!<|im_end|>", strings.Repeat("bakemo ", 50))
	for _, s := range texts {
		if got, want := tok.Encode(s), builtinEncodeReference(tok, s); !slices.Equal(got, want) {
			t.Errorf("Encode(%q) = %v, reference %v", s, got, want)
		}
	}
}

func FuzzBuiltinMatchesReference(f *testing.F) {
	for _, s := range []string{"", "Hello, world!", "<|im_start|>a\nb", "\xff\xfe", "naïve — 😀", "bakemo dubiza\tkabuto\u00a0x"} {
		f.Add(s)
	}
	tok := Builtin().(builtin)
	f.Fuzz(func(t *testing.T, s string) {
		if got, want := tok.Encode(s), builtinEncodeReference(tok, s); !slices.Equal(got, want) {
			t.Fatalf("Encode(%q) = %v, reference %v", s, got, want)
		}
	})
}
