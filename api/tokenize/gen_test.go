package tokenize

import (
	"math/rand/v2"
	"strings"
	"unicode/utf8"
)

// genTexts returns n random strings built to hit the places where
// tokenizers disagree: whitespace runs (CRLF, tabs, Unicode spaces), digit
// runs, CJK and kana (DeepSeek splits them out), Arabic, emoji with ZWJ
// and modifiers, combining marks and NFC/NFKC-sensitive text, control and
// format characters, special-token look-alikes (whole and cut), mixed-case
// contractions, code and long words. Deterministic for a seed. Every
// string is valid UTF-8, so the reference sees exactly what we see.
func genTexts(seed uint64, n int) []string {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	out := make([]string, n)
	var b strings.Builder
	for i := range out {
		b.Reset()
		parts := 1 + rng.IntN(12)
		if rng.IntN(10) == 0 {
			parts += rng.IntN(40)
		}
		for range parts {
			genPart(rng, &b)
		}
		out[i] = b.String()
	}
	return out
}

var (
	genSpaces = []string{" ", " ", " ", "  ", "\t", "\n", "\n", "\r\n", "\r", "\u00a0", "\u3000",
		"\u2009", "\u2028", "\u0085", "\v", "\f", "\u1680", "\u202f", "\u205f"}
	genSpecials = []string{"<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<bos>", "<eos>",
		"<unk>", "<pad>", "<mask>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜tool▁sep｜>",
		"<｜tool▁output▁begin｜>", "<|begin_of_text|>", "<|start_header_id|>", "<|eot_id|>",
		"<start_of_turn>", "<end_of_turn>", "<|return|>", "<|start|>", "<|channel|>", "<think>",
		"</think>", "<unused12>", "<|reserved_200016|>", "<tool_call>", "<0x41>", "<0xZZ>", "▁", "▁▁"}
	genWords = []string{"the", "The", "THE", "hello", "World", "camelCase", "XMLHttpRequest", "iPhone",
		"naïve", "café", "Straße", "ǅemal", "Ǆ", "ΑΒΓ", "αβγ", "Привет", "мир", "שלום", "हिन्दी", "ไทย",
		"한국어", "ﬁne", "Ｆｕｌｌ", "ｗｉｄｔｈ", "Ω", "Å", "x²", "KELVIN", "ſtraße", "İstanbul", "ŉ"}
	genContractions = []string{"'s", "'S", "'t", "'T", "'re", "'RE", "'Re", "'ve", "'VE", "'m", "'M", "'ll",
		"'LL", "'lL", "'d", "'D", "'ſ", "’s", "'", "''", "'x"}
	genEmoji = []string{"😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇺🇸", "🇯🇵", "❤️", "☺︎", "🧑🏿‍💻", "👩‍❤️‍💋‍👨",
		"#️⃣", "1️⃣", "🤷‍♀️", "🫠", "\u200d", "\ufe0f"}
	genCode = []string{"func main() {\n\tfmt.Println(\"hi\")\n}\n", "if (a == b && c != d) { return -1; }",
		"x := map[string]int{\"a\": 1}", "def f(x):\n    return x**2  # square\n", "#include <stdio.h>\n",
		"/* comment */ // line\n", "a->b", "i++;", "arr[i][j] = 0;", "<div class=\"x\">&amp;</div>",
		"https://example.com/a/b?c=d&e=f", "SELECT * FROM t WHERE id = 42;", "$ ls -la | grep .go",
		"  \n    \n", "\t\t", "==>", "...", "!!!", "?!", "---", "___", "\\n", "`code`", "@user", "/path/to/file"}
	genOdd = []string{"\ufffd", "\ufeff", "\ufffe", "\uffff", "\ue000", "\U000f0000", "\x00", "\x01", "\x1b",
		"\x1f", "\x7f", "\u0080", "\u200b", "\u200c", "\u2060", "\u00ad", "\u061c", "\u202e", "\u180e",
		"e\u0301", "\u0301", "a\u0308\u0301", "\u1100\u1161\u11a8", "\u0958", "\u2126", "\u212b", "\u00bd",
		"\u2460", "\U0001d400", "\U0001f1e6", "\U00020000", "\U0002a6d6", "\U000e0041", "\U000e0100"}
)

func genPart(rng *rand.Rand, b *strings.Builder) {
	pick := func(list []string) string { return list[rng.IntN(len(list))] }
	runes := func(lo, hi rune, n int) {
		for range n {
			b.WriteRune(lo + rune(rng.IntN(int(hi-lo+1))))
		}
	}
	switch rng.IntN(22) {
	case 0, 1:
		for k := 1 + rng.IntN(4); k > 0; k-- {
			b.WriteString(pick(genSpaces))
		}
	case 2:
		for k := 1 + rng.IntN(12); k > 0; k-- {
			b.WriteByte(byte('0' + rng.IntN(10)))
		}
	case 3:
		b.WriteString(pick([]string{"٣٤٥", "１２３", "²³", "Ⅻ", "½", "০১", "๓", "3.14", "1,000,000", "0x1F", "1e-10"}))
	case 4:
		runes(0x4e00, 0x9fa5, 1+rng.IntN(8))
	case 5:
		switch rng.IntN(4) {
		case 0:
			runes(0x3041, 0x3096, 1+rng.IntN(6))
		case 1:
			runes(0x30a1, 0x30fa, 1+rng.IntN(6))
		case 2:
			runes(0xff66, 0xff9d, 1+rng.IntN(4)) // halfwidth katakana (NFKC)
		default:
			runes(0x3400, 0x4dbf, 1+rng.IntN(3)) // CJK extension A
		}
	case 6:
		for k := 1 + rng.IntN(6); k > 0; k-- {
			runes(0x0621, 0x064a, 1)
			if rng.IntN(3) == 0 {
				runes(0x064b, 0x0652, 1)
			}
		}
	case 7:
		b.WriteString(pick(genEmoji))
	case 8:
		runes('a', 'z', 1)
		runes(0x0300, 0x036f, 1+rng.IntN(3))
	case 9:
		b.WriteString(pick(genOdd))
	case 10, 11:
		s := pick(genSpecials)
		if rng.IntN(3) == 0 { // a cut-off look-alike
			r := []rune(s)
			lo := rng.IntN(len(r))
			hi := lo + 1 + rng.IntN(len(r)-lo)
			s = string(r[lo:hi])
		}
		b.WriteString(s)
	case 12, 13, 14:
		w := pick(genWords)
		if rng.IntN(2) == 0 {
			b.WriteByte(' ')
		}
		b.WriteString(w)
		if rng.IntN(3) == 0 {
			b.WriteString(pick(genContractions))
		}
	case 15:
		b.WriteString(pick([]string{"don't", "I'M", "y'all's", "it's", "We'VE", "they'Re", "O'Neil", "rock'n'roll"}))
	case 16, 17:
		b.WriteString(pick(genCode))
	case 18:
		if rng.IntN(2) == 0 {
			b.WriteString(strings.Repeat(pick([]string{"a", "ab", "=", " ", "\n", "9", "好"}), 20+rng.IntN(200)))
		} else {
			runes('a', 'z', 20+rng.IntN(80))
		}
	case 19:
		b.WriteString(pick([]string{"!", ".", ",", "?", ":", ";", "(", ")", "[", "]", "{", "}", "\"", "-", "–", "—", "…", "«", "»", "、", "。", "，", "・", "/", "\\", "|"}))
	case 20:
		// Any scalar from the planes in use, assigned or not.
		for {
			r := rune(rng.IntN(0x30000))
			if utf8.ValidRune(r) {
				b.WriteRune(r)
				break
			}
		}
	default:
		runes('A', 'z', 1+rng.IntN(10))
	}
}
