// Package jsonscan reads the top-level values of a JSON request body in one
// pass. The proxy needs a handful of small fields (model, stream, n, …) and
// the prompt of bodies that are mostly one long prompt string; decoding
// them with encoding/json costs a validating scan plus a decoding scan per
// call, and the request path made several such calls per request (issue 31:
// ~0.3 ms of a 2,400-token completion's time to first token).
//
// Top is a fast path only: it vouches for a body only when its reading
// cannot differ from encoding/json's, and otherwise says so, and the caller
// decodes with encoding/json, whose answer (and error message) is the
// contract.
package jsonscan

import "encoding/binary"

// maxDepth is encoding/json's nesting limit: deeper documents are invalid
// there (an error the fallback reports in encoding/json's words).
const maxDepth = 10000

// Top scans body, which must be one JSON value, and returns the raw bytes
// of the values of the top-level object's keys named in keys (nil for a
// key absent), in the order of keys. ok is false, and vals nil, when the
// body is not valid JSON (as encoding/json.Valid judges), is not an
// object, names one of keys twice, or has a key that encoding/json might
// match to one of keys without spelling it exactly: one that differs in
// case only, or any key with an escape or a non-ASCII byte (encoding/json
// folds case with Unicode's simple folding, so "ſtream" is "stream").
// keys must be distinct ASCII strings.
func Top(body []byte, keys []string) (vals [][]byte, ok bool) {
	vals = make([][]byte, len(keys))
	if !TopInto(body, keys, vals) {
		return nil, false
	}
	return vals, true
}

// TopInto is Top into vals (len(vals) == len(keys)), which it clears
// first, for a caller that reads many small bodies without allocating.
func TopInto(body []byte, keys []string, vals [][]byte) bool {
	clear(vals)
	s := scanner{b: body}
	s.skipSpace()
	if s.i >= len(s.b) || s.b[s.i] != '{' {
		return false
	}
	if !s.topObject(keys, vals) {
		return false
	}
	s.skipSpace()
	return s.i == len(s.b)
}

type scanner struct {
	b []byte
	i int
}

// isSpace is JSON's whitespace.
func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

func (s *scanner) skipSpace() {
	for s.i < len(s.b) && isSpace(s.b[s.i]) {
		s.i++
	}
}

// topObject reads the top-level object at s.i ('{'), recording the values
// of keys.
func (s *scanner) topObject(keys []string, vals [][]byte) bool {
	s.i++ // '{'
	s.skipSpace()
	if s.i < len(s.b) && s.b[s.i] == '}' {
		s.i++
		return true
	}
	for {
		if s.i >= len(s.b) || s.b[s.i] != '"' {
			return false
		}
		start := s.i + 1
		plain, ok := s.str()
		if !ok {
			return false
		}
		key := s.b[start : s.i-1]
		slot := -1
		if !plain {
			return false // an escaped or non-ASCII key: let encoding/json match it
		}
		for k, want := range keys {
			if string(key) == want {
				if vals[k] != nil {
					return false // repeated: encoding/json's merging rules apply
				}
				slot = k
				break
			}
			if equalFoldASCII(key, want) {
				return false // encoding/json matches it case-insensitively
			}
		}
		s.skipSpace()
		if s.i >= len(s.b) || s.b[s.i] != ':' {
			return false
		}
		s.i++
		s.skipSpace()
		vstart := s.i
		if !s.value(1) {
			return false
		}
		if slot >= 0 {
			vals[slot] = s.b[vstart:s.i:s.i]
		}
		if more, ok := s.sep('}'); !more {
			return ok
		}
	}
}

// value reads one JSON value at s.i (no leading space), depth levels deep.
func (s *scanner) value(depth int) bool {
	if s.i >= len(s.b) {
		return false
	}
	switch c := s.b[s.i]; {
	case c == '"':
		_, ok := s.str()
		return ok
	case c == '{':
		return s.object(depth + 1)
	case c == '[':
		return s.array(depth + 1)
	case c == 't':
		return s.literal("true")
	case c == 'f':
		return s.literal("false")
	case c == 'n':
		return s.literal("null")
	case c == '-' || (c >= '0' && c <= '9'):
		return s.number()
	}
	return false
}

func (s *scanner) literal(lit string) bool {
	if len(s.b)-s.i < len(lit) || string(s.b[s.i:s.i+len(lit)]) != lit {
		return false
	}
	s.i += len(lit)
	return true
}

func (s *scanner) object(depth int) bool {
	if depth > maxDepth {
		return false
	}
	s.i++ // '{'
	s.skipSpace()
	if s.i < len(s.b) && s.b[s.i] == '}' {
		s.i++
		return true
	}
	for {
		if s.i >= len(s.b) || s.b[s.i] != '"' {
			return false
		}
		if _, ok := s.str(); !ok {
			return false
		}
		s.skipSpace()
		if s.i >= len(s.b) || s.b[s.i] != ':' {
			return false
		}
		s.i++
		s.skipSpace()
		if !s.value(depth) {
			return false
		}
		if more, ok := s.sep('}'); !more {
			return ok
		}
	}
}

func (s *scanner) array(depth int) bool {
	if depth > maxDepth {
		return false
	}
	s.i++ // '['
	s.skipSpace()
	if s.i < len(s.b) && s.b[s.i] == ']' {
		s.i++
		return true
	}
	for {
		if !s.value(depth) {
			return false
		}
		if more, ok := s.sep(']'); !more {
			return ok
		}
	}
}

// sep reads what follows a member or an element: a comma (more: another
// follows, after any space), the container's closing byte (done), or
// anything else (not valid JSON: ok false).
func (s *scanner) sep(closing byte) (more, ok bool) {
	s.skipSpace()
	if s.i >= len(s.b) {
		return false, false
	}
	switch s.b[s.i] {
	case ',':
		s.i++
		s.skipSpace()
		return true, true
	case closing:
		s.i++
		return false, true
	}
	return false, false
}

// strStop marks the bytes that end a run of plain string content: the
// quote, the backslash, control characters (invalid unescaped) and, so
// that plain can be reported, non-ASCII bytes.
var strStop = func() (t [256]bool) {
	for c := range 0x20 {
		t[c] = true
	}
	t['"'], t['\\'] = true, true
	for c := 0x80; c < 0x100; c++ {
		t[c] = true
	}
	return t
}()

// str reads a string at s.i ('"'). plain reports that it had neither
// escapes nor non-ASCII bytes (its bytes are its value). Invalid UTF-8 is
// valid JSON to encoding/json (decoding replaces it), so it is accepted.
func (s *scanner) str() (plain, ok bool) {
	b := s.b
	i := s.i + 1
	plain = true
	for {
		// Eight bytes at a time while none of them stops the run (a
		// prompt is mostly such bytes), then byte by byte.
		for i+8 <= len(b) && !stopsRun(binary.LittleEndian.Uint64(b[i:])) {
			i += 8
		}
		for i < len(b) && !strStop[b[i]] {
			i++
		}
		if i >= len(b) {
			return false, false
		}
		switch c := b[i]; {
		case c == '"':
			s.i = i + 1
			return plain, true
		case c == '\\':
			plain = false
			if i+1 >= len(b) {
				return false, false
			}
			switch b[i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i += 2
			case 'u':
				if i+6 > len(b) || !isHex(b[i+2]) || !isHex(b[i+3]) || !isHex(b[i+4]) || !isHex(b[i+5]) {
					return false, false
				}
				i += 6
			default:
				return false, false
			}
		case c < 0x20:
			return false, false
		default: // non-ASCII
			plain = false
			i++
		}
	}
}

// stopsRun reports whether any of the eight bytes packed in w is one of
// strStop's: below 0x20, '"', '\\' or non-ASCII (the classic "has a zero
// byte" and "has a byte less than n" tests, exact for n ≤ 0x80).
func stopsRun(w uint64) bool {
	const ones, highs = 0x0101010101010101, 0x8080808080808080
	below20 := (w - 0x20*ones) &^ w
	quote := w ^ ('"' * ones)
	backslash := w ^ ('\\' * ones)
	return (below20|(quote-ones)&^quote|(backslash-ones)&^backslash|w)&highs != 0
}

func isHex(c byte) bool {
	return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

// number reads a JSON number: -? (0 | [1-9][0-9]*) (.[0-9]+)? ([eE][+-]?[0-9]+)?
func (s *scanner) number() bool {
	b, i := s.b, s.i
	if b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case i < len(b) && b[i] >= '1' && b[i] <= '9':
		for i < len(b) && isDigit(b[i]) {
			i++
		}
	default:
		return false
	}
	if i < len(b) && b[i] == '.' {
		i++
		if i >= len(b) || !isDigit(b[i]) {
			return false
		}
		for i < len(b) && isDigit(b[i]) {
			i++
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if i >= len(b) || !isDigit(b[i]) {
			return false
		}
		for i < len(b) && isDigit(b[i]) {
			i++
		}
	}
	s.i = i
	return true
}

// equalFoldASCII reports whether a and b, ASCII, are equal ignoring case.
func equalFoldASCII(a []byte, b string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range len(a) {
		x, y := a[i], b[i]
		if 'A' <= x && x <= 'Z' {
			x += 'a' - 'A'
		}
		if 'A' <= y && y <= 'Z' {
			y += 'a' - 'A'
		}
		if x != y {
			return false
		}
	}
	return true
}

// Elements returns the raw bytes of the elements of arr, one JSON array
// (space around it allowed). ok is false, and elems nil, when arr is not
// one valid JSON array.
func Elements(arr []byte) (elems [][]byte, ok bool) {
	s := scanner{b: arr}
	s.skipSpace()
	if s.i >= len(s.b) || s.b[s.i] != '[' {
		return nil, false
	}
	s.i++
	s.skipSpace()
	if s.i < len(s.b) && s.b[s.i] == ']' {
		s.i++
	} else {
		for {
			start := s.i
			if !s.value(1) {
				return nil, false
			}
			elems = append(elems, s.b[start:s.i:s.i])
			more, ok := s.sep(']')
			if !ok {
				return nil, false
			}
			if !more {
				break
			}
		}
	}
	s.skipSpace()
	if s.i != len(s.b) {
		return nil, false
	}
	if elems == nil {
		elems = [][]byte{}
	}
	return elems, true
}
