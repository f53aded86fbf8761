package tokenize

import (
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
)

// FuzzBuiltinCut: Splitter's contract for the builtin tokenizer. Wherever
// s appears in a text (after any x, before any y), the ids of the text are
// the ids of its two pieces cut after s[:Cut(s)].
func FuzzBuiltinCut(f *testing.F) {
	for _, s := range [][3]string{
		{"", "bakemo dubiza ", "kabuto"},
		{"a", "b\nc", "d"},
		{"<|im_", "start|> x", "y"},
		{"x <|im_start", "|>\t", "<|im_end|>"},
		{"\xe2\x82", " \xac", "z"},
		{"naïve", " — 😀\u00a0", "\u2003q"},
		{"word", "word", "word"},
	} {
		f.Add(s[0], s[1], s[2])
	}
	tok := Builtin().(builtin)
	f.Fuzz(func(t *testing.T, x, s, y string) {
		p := tok.Cut(s)
		if p < 0 || p > len(s) {
			t.Fatalf("Cut(%q) = %d, out of range", s, p)
		}
		if p == 0 {
			return
		}
		a := x + s[:p]
		want := tok.Encode(a + s[p:] + y)
		if got := append(tok.Encode(a), tok.Encode(s[p:]+y)...); !slices.Equal(got, want) {
			t.Fatalf("cut after %q (x %q, rest %q): pieces give %v, the whole %v", s[:p], x, s[p:]+y, got, want)
		}
		if got := append(tok.EncodeSpecial(a), tok.Encode(s[p:]+y)...); !slices.Equal(got, tok.EncodeSpecial(a+s[p:]+y)) {
			t.Fatalf("EncodeSpecial: cut after %q does not split", s[:p])
		}
		if got := tok.AppendEncode([]uint32{7}, s); !slices.Equal(got, append([]uint32{7}, tok.Encode(s)...)) {
			t.Fatalf("AppendEncode(%q) = %v", s, got)
		}
	})
}

// FuzzPrefixCacheMatchesEncode: a prefix cache with a small chunk (so
// prompts have many places) gives exactly the tokenizer's ids for prompts
// that share beginnings in every way the fuzzer finds: the same prefix
// with different tails, a prompt extended (the next turn), cut inside a
// word or a special token, invalid UTF-8, entries evicted by a tiny
// budget.
func FuzzPrefixCacheMatchesEncode(f *testing.F) {
	f.Add("bakemo dubiza kabuto\nsefopu ", "tail one", "tail two, longer", uint8(8), uint16(4096), false)
	f.Add("<|im_start|>user\nhello <|im_", "end|> x", "start|>", uint8(3), uint16(64), true)
	f.Add("a b c d e f g h i j k l m n o p ", "\xff\xfe q", "r", uint8(4), uint16(0), false)
	f.Add(strings.Repeat("word ", 40), "more", strings.Repeat("x", 50), uint8(16), uint16(300), true)
	tok := Builtin().(builtin)
	f.Fuzz(func(t *testing.T, shared, tail1, tail2 string, chunk uint8, budget uint16, special bool) {
		c := NewPrefixCache(tok, int(chunk%32)+1, int(budget))
		for i, text := range []string{
			shared + tail1, shared + tail2, shared + tail1, // same prefix, other tails, a repeat
			shared + tail1 + tail2, shared, // a longer turn; the prefix alone
			tail1 + shared, shared + tail2 + tail1,
		} {
			want := tok.Encode(text)
			if got := c.Encode(text, special); !slices.Equal(got, want) {
				t.Fatalf("text %d %q: cache gives %v, Encode %v", i, text, got, want)
			}
		}
	})
}

// countingSplitter counts the bytes the cache asks its tokenizer to
// encode.
type countingSplitter struct {
	builtin
	bytes int
}

func (s *countingSplitter) Encode(text string) []uint32 {
	s.bytes += len(text)
	return s.builtin.Encode(text)
}

func (s *countingSplitter) EncodeSpecial(text string) []uint32 { return s.Encode(text) }

func (s *countingSplitter) AppendEncode(ids []uint32, text string) []uint32 {
	s.bytes += len(text)
	return s.builtin.AppendEncode(ids, text)
}

// wordsText is n random builtin words separated by spaces.
func wordsText(rng *rand.Rand, n int) string {
	var b strings.Builder
	for range n {
		b.WriteString(canonicalWord(uint32(rng.IntN(builtinWordCount))))
		b.WriteByte(' ')
	}
	return b.String()
}

// TestPrefixCacheReuses: what is reused and what is tokenized again, what
// is added, and that the ids stay exact each time.
func TestPrefixCacheReuses(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	shared := wordsText(rng, 2000) // 14,000 bytes: 13 places (one per KiB); with a tail, 15
	tailA, tailB := wordsText(rng, 300), wordsText(rng, 300)
	for _, tc := range []struct {
		name       string
		first      string // encoded twice before (a prompt's first KiB seen once adds nothing)
		text       string
		maxBytes   int // bytes the tokenizer may see for text
		minBytes   int
		wantPieces int // held afterwards
	}{
		{"cold: seen once, not added", "", shared + tailA, len(shared + tailA), len(shared + tailA), 0},
		{"its first KiB seen before: the rest added", tailB + shared, tailB + tailA, len(tailA) + PrefixCacheChunk, len(tailA), 15 + 2},
		{"same prompt again", shared + tailA, shared + tailA, PrefixCacheChunk, 1, 15},
		{"same prefix, other tail", shared + tailA, shared + tailB, len(tailB) + PrefixCacheChunk, len(tailB), 15 + 2},
		{"the next turn", shared, shared + tailA, len(tailA) + PrefixCacheChunk, len(tailA), 15},
		{"other text, seen once", shared, tailA + shared, len(tailA + shared), len(tailA + shared), 13},
		{"short prompts are not cached", "", tailA[:PrefixCacheChunk], PrefixCacheChunk, PrefixCacheChunk, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tok := &countingSplitter{}
			c := NewPrefixCache(tok, PrefixCacheChunk, 1<<20)
			if tc.first != "" {
				c.Encode(tc.first, false)
				c.Encode(tc.first, false)
			}
			tok.bytes = 0
			got := c.Encode(tc.text, false)
			if want := Builtin().Encode(tc.text); !slices.Equal(got, want) {
				t.Fatalf("ids differ from Encode's")
			}
			if tok.bytes > tc.maxBytes || tok.bytes < tc.minBytes {
				t.Errorf("tokenized %d bytes, want %d..%d", tok.bytes, tc.minBytes, tc.maxBytes)
			}
			if n := c.Len(); n != tc.wantPieces {
				t.Errorf("holds %d pieces, want %d", n, tc.wantPieces)
			}
		})
	}
}

// TestPrefixCacheBudget: pieces beyond the budget are evicted least
// recently used first, a prompt reused since stays, and the pieces two
// prompts share are held once.
func TestPrefixCacheBudget(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	var texts []string
	for range 4 {
		texts = append(texts, wordsText(rng, 1000)) // 7,000 bytes, 6 places
	}
	tok := &countingSplitter{}
	three := NewPrefixCache(tok, PrefixCacheChunk, 1<<20)
	for _, s := range texts[:3] {
		three.Encode(s, false)
		three.Encode(s, false) // the second time adds it
	}
	budget := three.used + 100 // three prompts fit, not four
	c := NewPrefixCache(tok, PrefixCacheChunk, budget)
	for _, s := range texts[:3] {
		c.Encode(s, false)
		c.Encode(s, false)
	}
	c.Encode(texts[0], false) // used again: texts[1] is now the oldest
	c.Encode(texts[3], false)
	c.Encode(texts[3], false)
	if c.used > budget {
		t.Fatalf("holds %d bytes, budget %d", c.used, budget)
	}
	// Held ones first: a full hit adds nothing, so nothing is evicted
	// before texts[1] is looked up.
	for _, i := range []int{0, 2, 3, 1} {
		tok.bytes = 0
		if got := c.Encode(texts[i], false); !slices.Equal(got, Builtin().Encode(texts[i])) {
			t.Fatalf("text %d: ids differ", i)
		}
		if reused, want := tok.bytes < len(texts[i])/2, i != 1; reused != want {
			t.Errorf("text %d: reused %v, want %v (tokenized %d of %d bytes)", i, reused, want, tok.bytes, len(texts[i]))
		}
	}
	// Many prompts over one shared prefix hold it once.
	c = NewPrefixCache(tok, PrefixCacheChunk, 1<<20)
	shared := wordsText(rng, 1000)
	for range 11 {
		c.Encode(shared+wordsText(rng, 300), false)
	}
	if n := c.Len(); n > 6+10*4 {
		t.Errorf("10 prompts over one 6-piece prefix hold %d pieces, want at most %d", n, 6+10*4)
	}
}

// TestPrefixCacheConcurrent: prompts sharing prefixes encoded from many
// goroutines get exact ids (run with -race).
func TestPrefixCacheConcurrent(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	shared := wordsText(rng, 800)
	var texts []string
	for range 16 {
		texts = append(texts, shared+wordsText(rng, 200))
	}
	tok := Builtin().(builtin)
	c := NewPrefixCache(tok, 256, 64<<10) // small: evictions while others read
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 64 {
				text := texts[(i*7+g)%len(texts)]
				if got := c.Encode(text, g%2 == 0); !slices.Equal(got, tok.Encode(text)) {
					t.Errorf("goroutine %d, text %d: ids differ", g, i)
					return
				}
			}
		})
	}
	wg.Wait()
}

// BenchmarkPrefixCacheEncode: kvbench's prompt shape (a 2,032-word shared
// prefix, 339-word tails) through the cache, against Encode alone.
func BenchmarkPrefixCacheEncode(b *testing.B) {
	rng := rand.New(rand.NewPCG(31, 4))
	shared := wordsText(rng, 2032)
	var texts []string
	for range 64 {
		texts = append(texts, shared+wordsText(rng, 339))
	}
	tok := Builtin().(builtin)
	b.Run("encode", func(b *testing.B) {
		i := 0
		for b.Loop() {
			tok.Encode(texts[i%len(texts)])
			i++
		}
	})
	b.Run("cache", func(b *testing.B) {
		c := NewPrefixCache(tok, PrefixCacheChunk, 16<<20)
		i := 0
		for b.Loop() {
			c.Encode(texts[i%len(texts)], false)
			i++
		}
	})
	// Every tail new (1 MiB holds the prefix and ~300 tails, fewer than
	// cycle here): the prefix is reused, the new tail's pieces are added
	// and old ones evicted.
	var fresh []string
	for range 1024 {
		fresh = append(fresh, shared+wordsText(rng, 339))
	}
	b.Run("cache-new-tails", func(b *testing.B) {
		c := NewPrefixCache(tok, PrefixCacheChunk, 1<<20)
		i := 0
		for b.Loop() {
			c.Encode(fresh[i%len(fresh)], false)
			i++
		}
	})
	// Nothing shared (the cache's worst case): every prompt is looked up,
	// missed, encoded piece by piece and added.
	var unique []string
	for range 1024 {
		unique = append(unique, wordsText(rng, 2371))
	}
	b.Run("encode-unique", func(b *testing.B) {
		i := 0
		for b.Loop() {
			tok.Encode(unique[i%len(unique)])
			i++
		}
	})
	b.Run("cache-unique", func(b *testing.B) {
		c := NewPrefixCache(tok, PrefixCacheChunk, 1<<20)
		i := 0
		for b.Loop() {
			c.Encode(unique[i%len(unique)], false)
			i++
		}
	})
}
