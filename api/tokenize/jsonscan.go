package tokenize

import (
	"errors"
	"fmt"
	"strconv"
	"unicode/utf16"
	"unicode/utf8"
)

// tokenizer.json files are large (Gemma's is 33 MB: 262k vocab entries and
// 515k merges), and encoding/json spends seconds on them, minutes under
// the race detector. jsonScanner is a small strict JSON reader for the two
// big parts, the model's vocab and merges, and for finding the spans of
// the other values, which encoding/json then decodes.

type jsonScanner struct {
	data []byte
	pos  int
}

var errJSONEnd = errors.New("unexpected end of JSON")

func (s *jsonScanner) errorf(format string, args ...any) error {
	return fmt.Errorf("json at byte %d: %s", s.pos, fmt.Sprintf(format, args...))
}

func (s *jsonScanner) skipSpace() {
	for s.pos < len(s.data) {
		switch s.data[s.pos] {
		case ' ', '\t', '\n', '\r':
			s.pos++
		default:
			return
		}
	}
}

// peek returns the next non-space byte without consuming it.
func (s *jsonScanner) peek() (byte, error) {
	s.skipSpace()
	if s.pos >= len(s.data) {
		return 0, errJSONEnd
	}
	return s.data[s.pos], nil
}

func (s *jsonScanner) expect(c byte) error {
	got, err := s.peek()
	if err != nil {
		return err
	}
	if got != c {
		return s.errorf("want %q, got %q", c, got)
	}
	s.pos++
	return nil
}

// str reads a string, decoding escapes; ill-formed UTF-8 and lone
// surrogates become U+FFFD, as encoding/json does.
func (s *jsonScanner) str() (string, error) {
	if err := s.expect('"'); err != nil {
		return "", err
	}
	start := s.pos
	// Fast path: no escapes, plain UTF-8.
	for s.pos < len(s.data) {
		c := s.data[s.pos]
		if c == '"' {
			raw := s.data[start:s.pos]
			s.pos++
			if utf8.Valid(raw) {
				return string(raw), nil
			}
			return sanitizeUTF8(string(raw)), nil
		}
		if c == '\\' || c < 0x20 {
			break
		}
		s.pos++
	}
	buf := append([]byte(nil), s.data[start:s.pos]...)
	for s.pos < len(s.data) {
		c := s.data[s.pos]
		switch {
		case c == '"':
			s.pos++
			return sanitizeUTF8(string(buf)), nil
		case c < 0x20:
			return "", s.errorf("control character in string")
		case c != '\\':
			buf = append(buf, c)
			s.pos++
			continue
		}
		if s.pos+1 >= len(s.data) {
			return "", errJSONEnd
		}
		e := s.data[s.pos+1]
		s.pos += 2
		switch e {
		case '"', '\\', '/':
			buf = append(buf, e)
		case 'b':
			buf = append(buf, '\b')
		case 'f':
			buf = append(buf, '\f')
		case 'n':
			buf = append(buf, '\n')
		case 'r':
			buf = append(buf, '\r')
		case 't':
			buf = append(buf, '\t')
		case 'u':
			r, err := s.hex4()
			if err != nil {
				return "", err
			}
			if utf16.IsSurrogate(r) {
				r2 := rune(-1)
				if s.pos+1 < len(s.data) && s.data[s.pos] == '\\' && s.data[s.pos+1] == 'u' {
					save := s.pos
					s.pos += 2
					if r2, err = s.hex4(); err != nil {
						return "", err
					}
					if dec := utf16.DecodeRune(r, r2); dec != utf8.RuneError {
						r = dec
					} else {
						s.pos = save // the second escape stands on its own
						r = utf8.RuneError
					}
				} else {
					r = utf8.RuneError
				}
			}
			buf = utf8.AppendRune(buf, r)
		default:
			return "", s.errorf("bad escape \\%c", e)
		}
	}
	return "", errJSONEnd
}

func (s *jsonScanner) hex4() (rune, error) {
	if s.pos+4 > len(s.data) {
		return 0, errJSONEnd
	}
	v, err := strconv.ParseUint(string(s.data[s.pos:s.pos+4]), 16, 32)
	if err != nil {
		return 0, s.errorf("bad \\u escape")
	}
	s.pos += 4
	return rune(v), nil
}

// uint32Value reads a non-negative integer that fits in uint32.
func (s *jsonScanner) uint32Value() (uint32, error) {
	s.skipSpace()
	start := s.pos
	for s.pos < len(s.data) && s.data[s.pos] >= '0' && s.data[s.pos] <= '9' {
		s.pos++
	}
	// JSON forbids leading zeros; a fraction or exponent is not an id.
	if s.pos == start || s.data[start] == '0' && s.pos-start > 1 {
		return 0, s.errorf("want a non-negative integer")
	}
	if s.pos < len(s.data) && (s.data[s.pos] == '.' || s.data[s.pos] == 'e' || s.data[s.pos] == 'E') {
		return 0, s.errorf("want an integer")
	}
	v, err := strconv.ParseUint(string(s.data[start:s.pos]), 10, 32)
	if err != nil {
		return 0, s.errorf("integer %s out of range", s.data[start:s.pos])
	}
	return uint32(v), nil
}

// each calls fn for every element of an array ('[') or every key of an
// object ('{', fn gets the key and must consume the value).
func (s *jsonScanner) each(open byte, fn func(key string) error) error {
	if err := s.expect(open); err != nil {
		return err
	}
	closer := byte(']')
	if open == '{' {
		closer = '}'
	}
	if c, err := s.peek(); err != nil {
		return err
	} else if c == closer {
		s.pos++
		return nil
	}
	for {
		var key string
		if open == '{' {
			k, err := s.str()
			if err != nil {
				return err
			}
			if err := s.expect(':'); err != nil {
				return err
			}
			key = k
		}
		if err := fn(key); err != nil {
			return err
		}
		c, err := s.peek()
		if err != nil {
			return err
		}
		s.pos++
		switch c {
		case ',':
		case closer:
			return nil
		default:
			return s.errorf("want ',' or %q, got %q", closer, c)
		}
	}
}

// skip consumes one value of any kind, checking its syntax, and returns
// its bytes.
func (s *jsonScanner) skip() ([]byte, error) {
	c, err := s.peek()
	if err != nil {
		return nil, err
	}
	start := s.pos
	switch {
	case c == '{' || c == '[':
		err = s.each(c, func(string) error { _, err := s.skip(); return err })
	case c == '"':
		_, err = s.str()
	case c == 't' || c == 'f' || c == 'n':
		for _, lit := range []string{"true", "false", "null"} {
			if len(s.data)-s.pos >= len(lit) && string(s.data[s.pos:s.pos+len(lit)]) == lit {
				s.pos += len(lit)
				return s.data[start:s.pos], nil
			}
		}
		err = s.errorf("bad literal")
	case c == '-' || c >= '0' && c <= '9':
		for s.pos < len(s.data) && isNumberByte(s.data[s.pos]) {
			s.pos++
		}
		if _, perr := strconv.ParseFloat(string(s.data[start:s.pos]), 64); perr != nil {
			err = s.errorf("bad number %s", s.data[start:s.pos])
		}
	default:
		err = s.errorf("unexpected %q", c)
	}
	return s.data[start:s.pos], err
}

func isNumberByte(c byte) bool {
	return c >= '0' && c <= '9' || c == '-' || c == '+' || c == '.' || c == 'e' || c == 'E'
}

// end checks that only whitespace follows.
func (s *jsonScanner) end() error {
	s.skipSpace()
	if s.pos != len(s.data) {
		return s.errorf("data after the top-level value")
	}
	return nil
}
