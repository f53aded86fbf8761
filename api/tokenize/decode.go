package tokenize

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"
)

// HF decodes by turning ids into token strings (added tokens by content,
// others by vocab spelling), running the decoder chain over the list of
// strings, and concatenating the result; without a decoder it joins the
// tokens with spaces. These are the decoders we reproduce.
type decoder interface {
	decodeChain(toks []string) []string
}

type decSequence []decoder

func (q decSequence) decodeChain(toks []string) []string {
	for _, d := range q {
		toks = d.decodeChain(toks)
	}
	return toks
}

// decByteLevel maps each token's byte-level runes back to bytes (a token
// with any other rune is taken as its UTF-8), concatenates everything and
// reads it as UTF-8 the way from_utf8_lossy does.
type decByteLevel struct{}

func (decByteLevel) decodeChain(toks []string) []string {
	var buf []byte
	for _, t := range toks {
		buf = appendByteLevel(buf, t)
	}
	return []string{lossyUTF8(buf)}
}

func appendByteLevel(buf []byte, tok string) []byte {
	if b, ok := vocabBytes(tok); ok {
		return append(buf, b...)
	}
	return append(buf, tok...)
}

// decReplace replaces a literal (or regex) pattern in each token.
type decReplace struct{ r normReplace }

func (d decReplace) decodeChain(toks []string) []string {
	for i, t := range toks {
		toks[i] = d.r.normalize(t)
	}
	return toks
}

// decByteFallback turns runs of <0xNN> tokens into the string their bytes
// spell, or one U+FFFD per byte if they are not valid UTF-8.
type decByteFallback struct{}

func (decByteFallback) decodeChain(toks []string) []string {
	out := toks[:0:0]
	var pending []byte
	flush := func() {
		if len(pending) == 0 {
			return
		}
		if utf8.Valid(pending) {
			out = append(out, string(pending))
		} else {
			for range pending {
				out = append(out, "\ufffd")
			}
		}
		pending = pending[:0]
	}
	for _, t := range toks {
		if len(t) == 6 && strings.HasPrefix(t, "<0x") && t[5] == '>' {
			if b, err := strconv.ParseUint(t[3:5], 16, 8); err == nil {
				pending = append(pending, byte(b))
				continue
			}
		}
		flush()
		out = append(out, t)
	}
	flush()
	return out
}

// decFuse joins all tokens into one.
type decFuse struct{}

func (decFuse) decodeChain(toks []string) []string { return []string{strings.Join(toks, "")} }

// decStrip removes up to start leading and stop trailing copies of content
// from each token.
type decStrip struct {
	content     rune
	start, stop int
}

func (d decStrip) decodeChain(toks []string) []string {
	for i, t := range toks {
		r := []rune(t)
		lo, hi := 0, len(r)
		for lo < d.start && lo < hi && r[lo] == d.content {
			lo++
		}
		for k := 0; k < d.stop && hi > lo && r[hi-1] == d.content; k++ {
			hi--
		}
		toks[i] = string(r[lo:hi])
	}
	return toks
}

// decMetaspace turns the replacement rune back into spaces, dropping it at
// the start of the first token unless prepend_scheme is "never".
type decMetaspace struct {
	repl      rune
	dropFirst bool
}

func (d decMetaspace) decodeChain(toks []string) []string {
	for i, t := range toks {
		var b strings.Builder
		for _, c := range t {
			switch {
			case c != d.repl:
				b.WriteRune(c)
			case i == 0 && d.dropFirst:
			default:
				b.WriteByte(' ')
			}
		}
		toks[i] = b.String()
	}
	return toks
}

func parseDecoder(raw json.RawMessage) (decoder, error) {
	if isNull(raw) {
		return nil, nil
	}
	c, err := component(raw, "decoder")
	if err != nil {
		return nil, err
	}
	switch c.Type {
	case "ByteLevel":
		return decByteLevel{}, nil
	case "ByteFallback":
		return decByteFallback{}, nil
	case "Fuse":
		return decFuse{}, nil
	case "Replace":
		if c.Content == nil {
			return nil, fmt.Errorf("decoder Replace: missing content")
		}
		m, lit, err := patternMatcher(c.Pattern)
		if err != nil {
			return nil, fmt.Errorf("decoder Replace: %w", err)
		}
		return decReplace{normReplace{literal: lit, re: m, content: *c.Content}}, nil
	case "Strip":
		if c.Content == nil || utf8.RuneCountInString(*c.Content) != 1 {
			return nil, fmt.Errorf("decoder Strip: content must be one character")
		}
		r, _ := utf8.DecodeRuneInString(*c.Content)
		return decStrip{content: r, start: c.Start, stop: c.Stop}, nil
	case "Metaspace":
		if c.Replacement == nil || utf8.RuneCountInString(*c.Replacement) != 1 {
			return nil, fmt.Errorf("decoder Metaspace: replacement must be one character")
		}
		r, _ := utf8.DecodeRuneInString(*c.Replacement)
		drop := c.PrependScheme == nil || *c.PrependScheme != "never"
		if c.AddPrefixSpace != nil && !*c.AddPrefixSpace {
			drop = false
		}
		return decMetaspace{repl: r, dropFirst: drop}, nil
	case "Sequence":
		var seq decSequence
		for i, sub := range c.Decoders {
			d, err := parseDecoder(sub)
			if err != nil {
				return nil, fmt.Errorf("decoder %d: %w", i, err)
			}
			if d != nil {
				seq = append(seq, d)
			}
		}
		return seq, nil
	}
	return nil, unsupported("decoder type %q", c.Type)
}
