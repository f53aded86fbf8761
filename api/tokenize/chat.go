package tokenize

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
)

// The worker tokenizes the prompt its chat template renders, not the raw
// messages, so the router must render the same string before encoding.
// Rather than embed a Jinja engine we implement the two templates we serve:
// ChatML (the Qwen2 tokenizer_config.json template, minus any text outside
// its {% %} blocks) and a plain one for the builtin tokenizer.

// Message is one chat message. Content is plain text; JSON decoding also
// accepts OpenAI content-part arrays and null (see ContentText).
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// UnmarshalJSON decodes an OpenAI chat message, flattening array content.
func (m *Message) UnmarshalJSON(data []byte) error {
	var raw struct {
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	}
	if err := json.Unmarshal(data, &raw); err != nil {
		return fmt.Errorf("tokenize: message: %w", err)
	}
	content, err := ContentText(raw.Content)
	if err != nil {
		return fmt.Errorf("tokenize: message (role %q): %w", raw.Role, err)
	}
	m.Role, m.Content = raw.Role, content
	return nil
}

// ContentText flattens an OpenAI message content to text. It accepts a
// string, null/absent (""; assistant messages with tool calls), or an array
// of content parts of which only {"type":"text","text":...} are supported.
// Text parts are joined with "\n", as vLLM does for string-format chat
// templates. Other parts (images, audio) are an error: their placeholder
// tokens depend on the model, and guessing would yield wrong hashes.
func ContentText(raw json.RawMessage) (string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return "", nil
	}
	switch raw[0] {
	case '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return "", fmt.Errorf("content: %w", err)
		}
		return s, nil
	case '[':
		var parts []struct {
			Type string  `json:"type"`
			Text *string `json:"text"`
		}
		if err := json.Unmarshal(raw, &parts); err != nil {
			return "", fmt.Errorf("content parts: %w", err)
		}
		texts := make([]string, 0, len(parts))
		for i, p := range parts {
			if p.Type != "text" {
				return "", fmt.Errorf("content part %d: unsupported type %q", i, p.Type)
			}
			if p.Text == nil {
				return "", fmt.Errorf("content part %d: text part without text", i)
			}
			texts = append(texts, *p.Text)
		}
		return strings.Join(texts, "\n"), nil
	}
	return "", errors.New("content: want a string, null or an array of parts")
}

// Template selects a chat template. The zero value is ChatML.
type Template int

const (
	// ChatML renders each message as "<|im_start|>{role}\n{content}<|im_end|>\n"
	// and the generation prompt as "<|im_start|>assistant\n" (Qwen2 and
	// other ChatML models).
	ChatML Template = iota
	// Plain renders each message as "{role}: {content}\n" and the generation
	// prompt as "assistant:". Meant for the builtin tokenizer.
	Plain
)

func (t Template) String() string {
	switch t {
	case ChatML:
		return "chatml"
	case Plain:
		return "plain"
	}
	return fmt.Sprintf("Template(%d)", int(t))
}

// ParseTemplate parses a template name as printed by String; "" is ChatML.
func ParseTemplate(name string) (Template, error) {
	switch strings.ToLower(name) {
	case "", "chatml":
		return ChatML, nil
	case "plain":
		return Plain, nil
	}
	return 0, fmt.Errorf("tokenize: unknown chat template %q (want chatml or plain)", name)
}

// RenderChat renders msgs into the prompt string the worker would tokenize,
// ending with the assistant's turn opener if addGenerationPrompt.
func RenderChat(msgs []Message, tmpl Template, addGenerationPrompt bool) (string, error) {
	var open, sep, close, gen string
	switch tmpl {
	case ChatML:
		open, sep, close, gen = "<|im_start|>", "\n", "<|im_end|>\n", "<|im_start|>assistant\n"
	case Plain:
		open, sep, close, gen = "", ": ", "\n", "assistant:"
	default:
		return "", fmt.Errorf("tokenize: render chat: unknown template %v", tmpl)
	}
	n := len(gen)
	for _, m := range msgs {
		n += len(open) + len(m.Role) + len(sep) + len(m.Content) + len(close)
	}
	var b strings.Builder
	b.Grow(n)
	for i, m := range msgs {
		if m.Role == "" {
			return "", fmt.Errorf("tokenize: render chat: message %d has no role", i)
		}
		b.WriteString(open)
		b.WriteString(m.Role)
		b.WriteString(sep)
		b.WriteString(m.Content)
		b.WriteString(close)
	}
	if addGenerationPrompt {
		b.WriteString(gen)
	}
	return b.String(), nil
}
