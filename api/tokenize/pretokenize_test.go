package tokenize

import (
	"bufio"
	"encoding/json"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"
)

// Each case follows from the pattern by hand: try the alternatives in order
// at each position, take the first that matches.
func TestSplitQwen2(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want []string
	}{
		{"words take one leading space", "Hello, world!", []string{"Hello", ",", " world", "!"}},
		{"CJK is \\p{L}", "Hello, world! 你好", []string{"Hello", ",", " world", "!", " 你好"}},
		{"contraction splits off", "don't", []string{"don", "'t"}},
		{"contractions ignore case", "DON'T I'M WE'LL", []string{"DON", "'T", " I", "'M", " WE", "'LL"}},
		{"long s folds to s", "it'ſ", []string{"it", "'ſ"}},
		{"'l alone is no contraction", "'lo", []string{"'lo"}},
		{"'sup: contraction first, no look-ahead", "'sup", []string{"'s", "up"}},
		{"space then apostrophe is punctuation", "a 'sup", []string{"a", " '", "sup"}},
		{"digits one at a time", "12345", []string{"1", "2", "3", "4", "5"}},
		{"space before digit stands alone", "in 2024", []string{"in", " ", "2", "0", "2", "4"}},
		{"decimal point", "3.14", []string{"3", ".", "1", "4"}},
		{"other numbers are \\p{N}", "½²٣", []string{"½", "²", "٣"}},
		{"one non-letter may prefix letters", "(hello) _x", []string{"(hello", ")", " _", "x"}}, // " _" is two
		{"tab prefixes a word", "a\tb", []string{"a", "\tb"}},
		{"newline never prefixes a word", "a\nb", []string{"a", "\n", "b"}},
		{"last space of a run goes to the word", "a   b", []string{"a", "  ", " b"}},
		{"single space before punctuation joins it", "a !", []string{"a", " !"}},
		{"two spaces before punctuation", "a  !", []string{"a", " ", " !"}},
		{"punctuation run keeps its newlines", "end.\n\nNext", []string{"end", ".\n\n", "Next"}},
		{"whitespace up to the last newline", "a \n \n  b", []string{"a", " \n \n", " ", " b"}},
		{"CRLF", "a\r\nb", []string{"a", "\r\n", "b"}},
		{"trailing whitespace kept whole", "a  ", []string{"a", "  "}},
		{"whitespace only", "   ", []string{"   "}},
		{"unicode spaces are \\s", "a\u3000\u3000b", []string{"a", "\u3000", "\u3000b"}},
		{"NEL is \\s but not a newline", "a\u0085\u0085b", []string{"a", "\u0085", "\u0085b"}},
		{"0x1C is not \\s", "a\x1cb", []string{"a", "\x1cb"}},
		{"emoji are punctuation-class", "hi 😀😀!", []string{"hi", " 😀😀!"}},
		{"combining mark is not a letter", "e\u0301t", []string{"e", "\u0301t"}},
		{"code", "x = f(y)\n", []string{"x", " =", " f", "(y", ")\n"}},
		{"empty", "", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := split(llamaSplitter{maxDigits: 1}, nil, tt.in); !slices.Equal(got, tt.want) {
				t.Errorf("split(%q) = %q, want %q", tt.in, got, tt.want)
			}
		})
	}
}

func TestSplitLlama3Digits(t *testing.T) {
	got := split(llamaSplitter{maxDigits: 3}, nil, "1234567 in 2024")
	want := []string{"123", "456", "7", " in", " ", "202", "4"}
	if !slices.Equal(got, want) {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestSplitGPT2(t *testing.T) {
	tests := []struct {
		in   string
		want []string
	}{
		{"Hello, world!", []string{"Hello", ",", " world", "!"}},
		{"don't DON'T", []string{"don", "'t", " DON", "'", "T"}}, // case-sensitive
		{"1234 56", []string{"1234", " 56"}},                     // digit runs, with space
		{"a\nb", []string{"a", "\n", "b"}},                       // no newline alternative
		{"a\n\nb", []string{"a", "\n", "\n", "b"}},               // \s+(?!\S) then \s+
		{"a  b", []string{"a", " ", " b"}},
		{"(x", []string{"(", "x"}}, // no non-letter prefix
		{"end.\n", []string{"end", ".", "\n"}},
	}
	for _, tt := range tests {
		if got := split(gpt2Splitter{}, nil, tt.in); !slices.Equal(got, tt.want) {
			t.Errorf("split(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func TestSplitterFor(t *testing.T) {
	for _, p := range []string{patternQwen2, patternLlama3, patternGPT2} {
		if _, ok := splitterFor(p); !ok {
			t.Errorf("splitterFor(%q) not recognised", p)
		}
	}
	if _, ok := splitterFor(`\w+|\s+`); ok {
		t.Error("unknown pattern accepted")
	}
}

// TestSplitTiles: for any input the pieces are non-empty and concatenate
// back to the input, including invalid UTF-8.
func TestSplitTiles(t *testing.T) {
	alphabet := []string{"a", "Z", "é", "你", "1", "٣", " ", "  ", "\t", "\n", "\r", "\u3000", "'", "s", "LL", "!", "😀", "\u0301", "\xff", "\xe4\xbd"}
	rng := rand.New(rand.NewPCG(1, 2))
	splitters := map[string]splitter{"qwen2": llamaSplitter{1}, "llama3": llamaSplitter{3}, "gpt2": gpt2Splitter{}}
	for i := 0; i < 5000; i++ {
		var b strings.Builder
		for n := rng.IntN(12); n >= 0; n-- {
			b.WriteString(alphabet[rng.IntN(len(alphabet))])
		}
		s := b.String()
		for name, sp := range splitters {
			pieces := split(sp, nil, s)
			for _, p := range pieces {
				if p == "" {
					t.Fatalf("%s: empty piece splitting %q", name, s)
				}
			}
			if got := strings.Join(pieces, ""); got != s {
				t.Fatalf("%s: pieces of %q join to %q", name, s, got)
			}
		}
	}
}

// goldenCase is one line of testdata/qwen2_golden.jsonl: a cross-check of
// our scanners and BPE on ~190 strings (hand-picked plus random). Its ids
// and splits are Hugging Face tokenizers' (Rust), written by
// testdata/gen_qwen2_golden.js (the command is in its header);
// TestQwen2GoldenRegenerates requires the committed file to be what that
// generator writes now.
type goldenCase struct {
	Text   string              `json:"text"`
	IDs    []uint32            `json:"ids"`
	Splits map[string][]string `json:"splits"`
}

func readGolden(t *testing.T) []goldenCase {
	t.Helper()
	f, err := os.Open("testdata/qwen2_golden.jsonl")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var cases []goldenCase
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var c goldenCase
		if err := json.Unmarshal(sc.Bytes(), &c); err != nil {
			t.Fatalf("golden line %d: %v", len(cases)+1, err)
		}
		cases = append(cases, c)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if len(cases) < 100 {
		t.Fatalf("golden file has only %d cases", len(cases))
	}
	return cases
}

func TestSplitGolden(t *testing.T) {
	splitters := map[string]splitter{"qwen2": llamaSplitter{1}, "llama3": llamaSplitter{3}, "gpt2": gpt2Splitter{}}
	for _, c := range readGolden(t) {
		if !utf8.ValidString(c.Text) {
			t.Fatalf("golden text %q is not UTF-8", c.Text)
		}
		for name, want := range c.Splits {
			sp, ok := splitters[name]
			if !ok {
				t.Fatalf("golden: unknown splitter %q", name)
			}
			if got := split(sp, nil, c.Text); !slices.Equal(got, want) && len(want) > 0 {
				t.Errorf("%s split(%q)\n got %q\nwant %q", name, c.Text, got, want)
			}
		}
	}
}
