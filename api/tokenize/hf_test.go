package tokenize

import (
	"slices"
	"testing"
)

// TestQwen2Exact checks ids known from the Qwen2 reference tokenizer.
func TestQwen2Exact(t *testing.T) {
	h := loadQwen2(t)
	tests := []struct {
		text string
		want []uint32
	}{
		{"Hello, world! 你好", []uint32{9707, 11, 1879, 0, 220, 108386}},
		{"<|im_start|>hello<|im_end|>", []uint32{151644, 14990, 151645}},
	}
	for _, tt := range tests {
		if got := h.Encode(tt.text); !slices.Equal(got, tt.want) {
			t.Errorf("Encode(%q) = %v, want %v", tt.text, got, tt.want)
		}
		if got := h.Decode(tt.want); got != tt.text {
			t.Errorf("Decode(%v) = %q, want %q", tt.want, got, tt.text)
		}
	}
}
