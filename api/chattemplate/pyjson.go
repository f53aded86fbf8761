package chattemplate

import (
	"fmt"
	"math"
	"math/big"
	"sort"
	"strconv"
	"strings"
	"unicode/utf16"
)

// dumpOptions are the json.dumps arguments HF's tojson filter exposes.
type dumpOptions struct {
	ensureASCII bool
	indent      string // "" with hasIndent false: compact one-line form
	hasIndent   bool
	itemSep     string
	keySep      string
	sortKeys    bool
}

// newDumpOptions applies json.dumps' defaults: separators are (", ", ": ")
// without indent and (",", ": ") with it.
func newDumpOptions() dumpOptions {
	return dumpOptions{itemSep: ", ", keySep: ": "}
}

// pyDumps is Python's json.dumps for the values templates hold.
func pyDumps(v any, opt dumpOptions) (string, error) {
	var b strings.Builder
	if err := dumpValue(&b, v, opt, 0); err != nil {
		return "", err
	}
	return b.String(), nil
}

func dumpValue(b *strings.Builder, v any, opt dumpOptions, level int) error {
	switch x := v.(type) {
	case nil:
		b.WriteString("null")
	case bool:
		if x {
			b.WriteString("true")
		} else {
			b.WriteString("false")
		}
	case int64:
		b.WriteString(strconv.FormatInt(x, 10))
	case int:
		b.WriteString(strconv.Itoa(x))
	case *big.Int:
		b.WriteString(x.String())
	case float64:
		b.WriteString(pyFloatJSON(x))
	case string:
		dumpString(b, x, opt.ensureASCII)
	case []any:
		if len(x) == 0 {
			b.WriteString("[]")
			return nil
		}
		b.WriteByte('[')
		for i, e := range x {
			if i > 0 {
				b.WriteString(opt.itemSep)
			}
			newline(b, opt, level+1)
			if err := dumpValue(b, e, opt, level+1); err != nil {
				return err
			}
		}
		newline(b, opt, level)
		b.WriteByte(']')
	case *Object:
		if x.Len() == 0 {
			b.WriteString("{}")
			return nil
		}
		keys := x.Keys()
		if opt.sortKeys {
			keys = append([]string(nil), keys...)
			sort.Strings(keys) // Python compares str keys by code point, as Go compares UTF-8 bytes
		}
		b.WriteByte('{')
		for i, k := range keys {
			if i > 0 {
				b.WriteString(opt.itemSep)
			}
			newline(b, opt, level+1)
			dumpString(b, k, opt.ensureASCII)
			b.WriteString(opt.keySep)
			e, _ := x.Get(k)
			if err := dumpValue(b, e, opt, level+1); err != nil {
				return err
			}
		}
		newline(b, opt, level)
		b.WriteByte('}')
	default:
		return fmt.Errorf("TypeError: Object of type %T is not JSON serializable", v)
	}
	return nil
}

func newline(b *strings.Builder, opt dumpOptions, level int) {
	if !opt.hasIndent {
		return
	}
	b.WriteByte('\n')
	for range level {
		b.WriteString(opt.indent)
	}
}

// dumpString quotes s as json.dumps does: only '"', '\\' and control
// characters below 0x20 are escaped (DEL and U+2028 are not, unlike Go's
// encoding/json); with ensureASCII every non-ASCII rune becomes \uXXXX,
// astral ones as a surrogate pair.
func dumpString(b *strings.Builder, s string, ensureASCII bool) {
	b.WriteByte('"')
	for _, r := range s {
		switch r {
		case '"':
			b.WriteString(`\"`)
		case '\\':
			b.WriteString(`\\`)
		case '\n':
			b.WriteString(`\n`)
		case '\r':
			b.WriteString(`\r`)
		case '\t':
			b.WriteString(`\t`)
		case '\b':
			b.WriteString(`\b`)
		case '\f':
			b.WriteString(`\f`)
		default:
			switch {
			case r < 0x20:
				fmt.Fprintf(b, `\u%04x`, r)
			case ensureASCII && r > 0x7e:
				if r > 0xffff {
					r1, r2 := utf16.EncodeRune(r)
					fmt.Fprintf(b, `\u%04x\u%04x`, r1, r2)
				} else {
					fmt.Fprintf(b, `\u%04x`, r)
				}
			default:
				b.WriteRune(r)
			}
		}
	}
	b.WriteByte('"')
}

// pyFloatJSON is float.__repr__ with json.dumps' names for the
// non-finite values.
func pyFloatJSON(f float64) string {
	switch {
	case math.IsNaN(f):
		return "NaN"
	case math.IsInf(f, 1):
		return "Infinity"
	case math.IsInf(f, -1):
		return "-Infinity"
	}
	return pyFloatRepr(f)
}

// pyFloatRepr is Python's repr(float): the shortest digits that round-trip,
// positional when the decimal exponent is in [-4, 16), otherwise scientific
// with a signed exponent of at least two digits; a whole number keeps ".0".
func pyFloatRepr(f float64) string {
	switch {
	case math.IsNaN(f):
		return "nan"
	case math.IsInf(f, 1):
		return "inf"
	case math.IsInf(f, -1):
		return "-inf"
	}
	e := strconv.FormatFloat(f, 'e', -1, 64) // like -1.2345e+06
	sign := ""
	if e[0] == '-' {
		sign, e = "-", e[1:]
	}
	mant, expStr, _ := strings.Cut(e, "e")
	exp, _ := strconv.Atoi(expStr)
	digits := strings.Replace(mant, ".", "", 1)
	if exp < -4 || exp >= 16 {
		m := digits[:1]
		if len(digits) > 1 {
			m += "." + digits[1:]
		}
		es := strconv.Itoa(abs(exp))
		if len(es) < 2 {
			es = "0" + es
		}
		if exp < 0 {
			return sign + m + "e-" + es
		}
		return sign + m + "e+" + es
	}
	if exp < 0 {
		return sign + "0." + strings.Repeat("0", -exp-1) + digits
	}
	if len(digits) <= exp+1 {
		return sign + digits + strings.Repeat("0", exp+1-len(digits)) + ".0"
	}
	return sign + digits[:exp+1] + "." + digits[exp+1:]
}

func abs(n int) int {
	if n < 0 {
		return -n
	}
	return n
}
