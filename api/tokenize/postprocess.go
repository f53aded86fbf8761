package tokenize

import (
	"encoding/json"
	"fmt"
)

// postProcessor is what HF's post-processor adds around a single sequence
// when encoding with add_special_tokens=true. Only ids matter to us:
// ByteLevel (which only trims offsets) is the identity, TemplateProcessing,
// BertProcessing and RobertaProcessing wrap the sequence in special
// tokens, and a Sequence applies its processors in order.
type postProcessor struct {
	// steps are applied in order; each wraps the ids so far.
	steps []postStep
}

// postStep puts before in front of the ids and after behind them.
type postStep struct {
	before, after []uint32
}

func (p *postProcessor) apply(ids []uint32) []uint32 {
	for _, st := range p.steps {
		out := make([]uint32, 0, len(st.before)+len(ids)+len(st.after))
		out = append(append(append(out, st.before...), ids...), st.after...)
		ids = out
	}
	return ids
}

func parsePostProcessor(raw json.RawMessage) (*postProcessor, error) {
	p := &postProcessor{}
	if isNull(raw) {
		return p, nil
	}
	return p, addPostSteps(p, raw)
}

func addPostSteps(p *postProcessor, raw json.RawMessage) error {
	c, err := component(raw, "post_processor")
	if err != nil {
		return err
	}
	switch c.Type {
	case "ByteLevel":
		return nil
	case "Sequence":
		for i, sub := range c.Processors {
			if err := addPostSteps(p, sub); err != nil {
				return fmt.Errorf("post_processor %d: %w", i, err)
			}
		}
		return nil
	case "TemplateProcessing":
		return addTemplate(p, c)
	case "BertProcessing", "RobertaProcessing":
		// Single sequence: cls A sep.
		cls, err := tokenPairID(c.Cls)
		if err != nil {
			return fmt.Errorf("post_processor %s cls: %w", c.Type, err)
		}
		sep, err := tokenPairID(c.Sep)
		if err != nil {
			return fmt.Errorf("post_processor %s sep: %w", c.Type, err)
		}
		p.steps = append(p.steps, postStep{before: []uint32{cls}, after: []uint32{sep}})
		return nil
	}
	return unsupported("post_processor type %q", c.Type)
}

// addTemplate reads TemplateProcessing's single template: special tokens
// around exactly one $A.
func addTemplate(p *postProcessor, c hfComponent) error {
	var st postStep
	seen := false
	for i, item := range c.Single {
		switch {
		case item.Sequence != nil && item.SpecialToken == nil:
			if item.Sequence.ID != "A" || seen {
				return unsupported("TemplateProcessing single template with sequence %q at %d (want one $A)", item.Sequence.ID, i)
			}
			seen = true
		case item.SpecialToken != nil && item.Sequence == nil:
			tok, ok := c.SpecialTokens[item.SpecialToken.ID]
			if !ok {
				return fmt.Errorf("post_processor TemplateProcessing: special token %q not in special_tokens", item.SpecialToken.ID)
			}
			for _, id := range tok.IDs {
				if id >= maxTokenID {
					return fmt.Errorf("post_processor TemplateProcessing: id %d too large", id)
				}
			}
			if seen {
				st.after = append(st.after, tok.IDs...)
			} else {
				st.before = append(st.before, tok.IDs...)
			}
		default:
			return fmt.Errorf("post_processor TemplateProcessing: single[%d] must be one SpecialToken or Sequence", i)
		}
	}
	if !seen {
		return unsupported("TemplateProcessing single template without $A")
	}
	p.steps = append(p.steps, postStep{st.before, st.after})
	return nil
}

// tokenPairID reads a ["token", id] pair.
func tokenPairID(pair []json.RawMessage) (uint32, error) {
	if len(pair) != 2 {
		return 0, fmt.Errorf("want [token, id]")
	}
	var id uint32
	if err := json.Unmarshal(pair[1], &id); err != nil {
		return 0, err
	}
	if id >= maxTokenID {
		return 0, fmt.Errorf("id %d too large", id)
	}
	return id, nil
}
