package tokenize

import (
	"unicode/utf8"
)

// Byte-level BPE (GPT-2 and descendants) never sees raw bytes in its vocab
// files: every byte is first mapped to a printable rune (GPT-2's
// bytes_to_unicode) so that vocab and merges can be stored as text. Bytes
// that are already printable map to themselves; the other 68 bytes map to
// U+0100 and up, in byte order. Space (0x20), for instance, becomes 'Ġ'
// (U+0120), which is why vocab entries look like "Ġworld".
//
// Internally we run BPE on raw bytes and only translate at load time
// (vocab strings -> raw bytes), so Encode never builds mapped strings.

// byteRunes maps a byte to its vocab rune. runeBytes is the inverse; -1 marks
// runes that are not the image of any byte.
var byteRunes, runeBytes = buildByteTables()

func buildByteTables() (br [256]rune, rb [324]int16) {
	for i := range rb {
		rb[i] = -1
	}
	printable := func(b int) bool {
		return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF)
	}
	next := rune(256)
	for b := 0; b < 256; b++ {
		if printable(b) {
			br[b] = rune(b)
		} else {
			br[b] = next
			next++
		}
		rb[br[b]] = int16(b)
	}
	return br, rb
}

// vocabBytes converts a vocab token ("Ġworld") to the raw bytes it stands for
// (" world"). ok is false if some rune is not a byte-level rune.
func vocabBytes(tok string) (b []byte, ok bool) {
	b = make([]byte, 0, len(tok))
	for _, r := range tok {
		if r < 0 || int(r) >= len(runeBytes) || runeBytes[r] < 0 {
			return nil, false
		}
		b = append(b, byte(runeBytes[r]))
	}
	return b, true
}

// lossyUTF8 converts decoded bytes to a string the way Rust's
// String::from_utf8_lossy does (the HF ByteLevel decoder ends with it): each
// maximal ill-formed subpart becomes one U+FFFD. Go's own conversions replace
// each bad byte separately, which would make a cut-off 3-byte character
// decode to two replacement characters instead of one.
func lossyUTF8(b []byte) string {
	if utf8.Valid(b) {
		return string(b)
	}
	out := make([]byte, 0, len(b)+8)
	for i := 0; i < len(b); {
		if b[i] < utf8.RuneSelf {
			out = append(out, b[i])
			i++
			continue
		}
		r, w := utf8.DecodeRune(b[i:])
		if r != utf8.RuneError || w > 1 {
			out = append(out, b[i:i+w]...)
			i += w
			continue
		}
		out = utf8.AppendRune(out, utf8.RuneError)
		i += maximalSubpart(b[i:])
	}
	return string(out)
}

// maximalSubpart returns the length of the longest prefix of b (at least 1)
// that is a truncated but otherwise well-formed UTF-8 sequence (Unicode
// Table 3-7), for a b that does not start with a valid sequence.
func maximalSubpart(b []byte) int {
	lo, hi := byte(0x80), byte(0xBF) // allowed range of the 2nd byte
	var need int                     // continuation bytes after the lead
	switch c := b[0]; {
	case c >= 0xC2 && c <= 0xDF:
		need = 1
	case c == 0xE0:
		need, lo = 2, 0xA0
	case c == 0xED:
		need, hi = 2, 0x9F
	case c >= 0xE1 && c <= 0xEF:
		need = 2
	case c == 0xF0:
		need, lo = 3, 0x90
	case c == 0xF4:
		need, hi = 3, 0x8F
	case c >= 0xF1 && c <= 0xF3:
		need = 3
	default:
		return 1
	}
	n := 1
	for k := 0; k < need && n < len(b); k++ {
		if b[n] < lo || b[n] > hi {
			break
		}
		n++
		lo, hi = 0x80, 0xBF
	}
	return n
}

// sanitizeUTF8 replaces each invalid byte with U+FFFD, as encoding/json does
// when it decodes a request body. The worker only ever sees valid text (its
// HTTP layer decoded the same JSON), so this is the string it tokenized.
func sanitizeUTF8(s string) string {
	if utf8.ValidString(s) {
		return s
	}
	out := make([]byte, 0, len(s)+8)
	for i := 0; i < len(s); {
		r, w := utf8.DecodeRuneInString(s[i:])
		out = utf8.AppendRune(out, r)
		i += w
	}
	return string(out)
}
