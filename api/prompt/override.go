package prompt

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
)

// WithChatTemplate returns a copy of m that renders chat requests with the
// Jinja template src instead of the one its files name, as vLLM's
// --chat-template does. The copy's fingerprint differs from m's: its ids
// are no longer those the files alone give.
func (m *Model) WithChatTemplate(src string) (*Model, error) {
	var special map[string]any
	if j, ok := m.chat.(*jinjaChat); ok {
		special = j.special
	}
	chat, err := parseChat(m.name, src, special)
	if err != nil {
		return nil, fmt.Errorf("model %s: chat template override: %w", m.name, err)
	}
	c := *m
	c.chat = chat
	sum := sha256.Sum256([]byte(src))
	c.fingerprint = m.fingerprint + "+template:" + hex.EncodeToString(sum[:4])
	return &c, nil
}
