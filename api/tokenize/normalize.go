package tokenize

import (
	"strings"

	"golang.org/x/text/unicode/norm"
)

// A normalizer rewrites text before pre-tokenization, as HF's normalizers
// do. HF normalises each stretch of text between raw (normalized=false)
// added tokens separately, and the content of normalized=true added tokens
// too, so Prepend adds its prefix once per stretch.
type normalizer interface {
	normalize(s string) string
}

// normSequence applies its normalizers in order.
type normSequence []normalizer

func (q normSequence) normalize(s string) string {
	for _, n := range q {
		s = n.normalize(s)
	}
	return s
}

// normForm is one of NFC, NFD, NFKC, NFKD.
type normForm struct{ form norm.Form }

func (f normForm) normalize(s string) string { return f.form.String(s) }

// normReplace replaces every non-overlapping match of its pattern, left to
// right, with content (HF's Replace; a String pattern is a literal).
type normReplace struct {
	literal string  // set for a String pattern
	re      matcher // set for a Regex pattern
	content string
}

func (r normReplace) normalize(s string) string {
	if r.re == nil {
		return strings.ReplaceAll(s, r.literal, r.content)
	}
	var b strings.Builder
	for len(s) > 0 {
		start, end, ok := r.re.find(s)
		if !ok {
			break
		}
		b.WriteString(s[:start])
		b.WriteString(r.content)
		s = s[end:]
	}
	if b.Len() == 0 {
		return s
	}
	b.WriteString(s)
	return b.String()
}

// normPrepend puts its text before any non-empty input (HF's Prepend).
type normPrepend struct{ prefix string }

func (p normPrepend) normalize(s string) string {
	if s == "" {
		return s
	}
	return p.prefix + s
}
