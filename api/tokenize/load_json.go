package tokenize

import (
	"encoding/json"
	"fmt"
	"strings"
	"unicode/utf8"
)

// readHFFile reads tokenizer.json with jsonScanner: the model's vocab and
// merges directly, every other value through encoding/json.
func readHFFile(data []byte) (hfFile, hfModel, error) {
	var f hfFile
	var m hfModel
	var modelRaw []byte
	// Hugging Face reads the file into a Rust String, which refuses
	// ill-formed UTF-8; a file the engine cannot load is refused here too
	// rather than read with U+FFFD in place of its bytes.
	if !utf8.Valid(data) {
		i := 0
		for i < len(data) {
			r, w := utf8.DecodeRune(data[i:])
			if r == utf8.RuneError && w <= 1 {
				break
			}
			i += w
		}
		return f, m, fmt.Errorf("not valid UTF-8 (byte %d); Hugging Face tokenizers refuses such a file", i)
	}
	s := &jsonScanner{data: data}
	err := s.each('{', func(key string) error {
		if key == "model" {
			start := s.pos
			if c, err := s.peek(); err == nil && c == '{' {
				return readModel(s, &m)
			}
			if _, err := s.skip(); err != nil {
				return err
			}
			modelRaw = s.data[start:s.pos]
			return nil
		}
		raw, err := s.skip()
		if err != nil {
			return err
		}
		switch key {
		case "added_tokens":
			f.AddedTokens = nil
			if err := json.Unmarshal(raw, &f.AddedTokens); err != nil {
				return fmt.Errorf("added_tokens: %w", err)
			}
		case "normalizer":
			f.Normalizer = raw
		case "pre_tokenizer":
			f.PreTokenizer = raw
		case "post_processor":
			f.PostProcessor = raw
		case "decoder":
			f.Decoder = raw
		}
		return nil
	})
	if err == nil {
		err = s.end()
	}
	if err != nil {
		return f, m, fmt.Errorf("parse json: %w", err)
	}
	if modelRaw != nil {
		f.Model = modelRaw // not an object: let parseModel report it
	} else if m.present {
		f.Model = json.RawMessage("{}")
	}
	return f, m, nil
}

// readModel reads the model object: vocab and merges by hand, the other
// (small) fields through encoding/json.
func readModel(s *jsonScanner, m *hfModel) error {
	*m = hfModel{present: true}
	var rest []string // "key":value pairs of the other fields
	err := s.each('{', func(key string) error {
		switch key {
		case "vocab":
			if c, err := s.peek(); err == nil && c == 'n' {
				_, err := s.skip() // null
				m.Vocab = nil
				return err
			}
			m.Vocab = make(map[string]uint32)
			return s.each('{', func(tok string) error {
				id, err := s.uint32Value()
				if err != nil {
					return fmt.Errorf("model: vocab %q: %w", tok, err)
				}
				m.Vocab[tok] = id
				return nil
			})
		case "merges":
			if c, err := s.peek(); err == nil && c == 'n' {
				_, err := s.skip()
				m.Merges = nil
				return err
			}
			m.Merges = m.Merges[:0]
			return s.each('[', func(string) error {
				mg, err := readMerge(s)
				if err != nil {
					return fmt.Errorf("model: merge %d: %w", len(m.Merges), err)
				}
				m.Merges = append(m.Merges, mg)
				return nil
			})
		}
		raw, err := s.skip()
		if err != nil {
			return err
		}
		k, _ := json.Marshal(key)
		rest = append(rest, string(k)+":"+string(raw))
		return nil
	})
	if err != nil {
		return err
	}
	vocab, merges := m.Vocab, m.Merges
	if err := json.Unmarshal([]byte("{"+strings.Join(rest, ",")+"}"), m); err != nil {
		return fmt.Errorf("model: %w", err)
	}
	m.Vocab, m.Merges, m.present = vocab, merges, true
	return nil
}

// readMerge reads "a b" or ["a", "b"].
func readMerge(s *jsonScanner) (hfMerge, error) {
	c, err := s.peek()
	if err != nil {
		return hfMerge{}, err
	}
	if c == '"' {
		str, err := s.str()
		if err != nil {
			return hfMerge{}, err
		}
		a, b, ok := strings.Cut(str, " ")
		if !ok || strings.Contains(b, " ") {
			return hfMerge{}, fmt.Errorf("%q: want two space-separated tokens", str)
		}
		return hfMerge{a, b}, nil
	}
	var parts []string
	err = s.each('[', func(string) error {
		p, err := s.str()
		parts = append(parts, p)
		return err
	})
	if err != nil {
		return hfMerge{}, err
	}
	if len(parts) != 2 {
		return hfMerge{}, fmt.Errorf("want two tokens, got %d", len(parts))
	}
	return hfMerge{parts[0], parts[1]}, nil
}
