package api

import (
	"bytes"
	"encoding/json"
	"fmt"

	"github.com/kvrouter/kvrouter/api/prompt"
)

// ResponsesToChat is responsesToChat for a worker that serves the
// Responses API by rendering it as the router does (kvmock), so both
// compute the same prompt.
func ResponsesToChat(body []byte) ([]byte, error) { return responsesToChat(body) }

// responsesToChat turns an OpenAI Responses API body into the chat
// completions body vLLM's responses endpoint renders
// (serving_responses.py _construct_input_messages and responses_utils.py
// construct_chat_message_with_tool_call):
//
//   - instructions → a first {"role": "system"} message;
//   - input as a string → one {"role": "user"} message;
//   - input as a list: message items (role and content; input_text /
//     output_text parts are text to the chat template) pass through;
//     function_call → an assistant message with one tool call;
//     function_call_output → a {"role": "tool"} message; reasoning → an
//     assistant message with "reasoning" (its one summary or content text;
//     encrypted reasoning is refused, as vLLM does);
//   - function tools → chat tools ({"type": "function", "function": {name,
//     description, parameters}}, responses_utils.py construct_tool_dicts);
//     built-in tools (web search, file search, …) are not part of the prompt.
//
// previous_response_id (history stored on the worker) cannot be rendered
// here: such a request is routed by its new input only. Any other shape is a
// RequestError (400) naming it.
func responsesToChat(body []byte) ([]byte, error) {
	var in struct {
		Input        json.RawMessage   `json:"input"`
		Instructions *string           `json:"instructions"`
		Tools        []json.RawMessage `json:"tools"`
	}
	if err := json.Unmarshal(body, &in); err != nil {
		return nil, bad("invalid JSON body: %v", err)
	}
	var msgs []any
	if in.Instructions != nil && *in.Instructions != "" {
		msgs = append(msgs, map[string]any{"role": "system", "content": *in.Instructions})
	}
	raw := bytes.TrimSpace(in.Input)
	if len(raw) == 0 || isNull(raw) {
		return nil, bad("responses: \"input\" is required (a string or a list of input items)")
	}
	var text string
	var items []json.RawMessage
	switch {
	case json.Unmarshal(raw, &text) == nil:
		msgs = append(msgs, map[string]any{"role": "user", "content": text})
	case json.Unmarshal(raw, &items) == nil:
		if len(items) == 0 {
			return nil, bad("responses: \"input\" must not be an empty list")
		}
		for i, it := range items {
			m, err := responseItem(it)
			if err != nil {
				return nil, bad("responses: input[%d]: %v", i, err)
			}
			msgs = append(msgs, m)
		}
	default:
		return nil, bad("responses: \"input\" must be a string or a list of input items")
	}
	var tools []any
	for i, t := range in.Tools {
		var tool struct {
			Type        string          `json:"type"`
			Name        string          `json:"name"`
			Description *string         `json:"description"`
			Parameters  json.RawMessage `json:"parameters"`
		}
		if err := json.Unmarshal(t, &tool); err != nil {
			return nil, bad("responses: tools[%d]: want an object", i)
		}
		if tool.Type != "function" {
			continue
		}
		if tool.Name == "" {
			return nil, bad("responses: tools[%d]: a function tool needs a \"name\"", i)
		}
		fn := map[string]any{"name": tool.Name}
		if tool.Description != nil {
			fn["description"] = *tool.Description
		}
		if len(tool.Parameters) > 0 && !isNull(tool.Parameters) {
			fn["parameters"] = tool.Parameters
		}
		tools = append(tools, map[string]any{"type": "function", "function": fn})
	}
	chat := map[string]any{"messages": msgs}
	if len(tools) > 0 {
		chat["tools"] = tools
	}
	return json.Marshal(chat)
}

// responseItem converts one Responses input item to a chat message.
func responseItem(raw json.RawMessage) (any, error) {
	var it struct {
		Type      string          `json:"type"`
		Role      string          `json:"role"`
		Content   json.RawMessage `json:"content"`
		CallID    string          `json:"call_id"`
		Name      string          `json:"name"`
		Arguments string          `json:"arguments"`
		Output    json.RawMessage `json:"output"`
		Summary   []struct {
			Text string `json:"text"`
		} `json:"summary"`
		Encrypted *string `json:"encrypted_content"`
	}
	if err := json.Unmarshal(raw, &it); err != nil {
		return nil, fmt.Errorf("want an input item object")
	}
	switch it.Type {
	case "", "message":
		if it.Role == "" {
			return nil, fmt.Errorf("a message item needs a \"role\"")
		}
		return map[string]any{"role": it.Role, "content": textParts(it.Content)}, nil
	case "function_call":
		return map[string]any{"role": "assistant", "tool_calls": []any{map[string]any{
			"id": it.CallID, "type": "function", "function": map[string]any{"name": it.Name, "arguments": it.Arguments}}}}, nil
	case "function_call_output":
		var out any = it.Output
		var s string
		if json.Unmarshal(it.Output, &s) == nil {
			out = s
		}
		return map[string]any{"role": "tool", "content": out, "tool_call_id": it.CallID}, nil
	case "reasoning":
		if it.Encrypted != nil && *it.Encrypted != "" {
			return nil, fmt.Errorf("encrypted reasoning content is not supported")
		}
		var texts []struct {
			Text string `json:"text"`
		}
		_ = json.Unmarshal(it.Content, &texts)
		text := ""
		switch {
		case len(it.Summary) == 1:
			text = it.Summary[0].Text
		case len(texts) == 1:
			text = texts[0].Text
		}
		return map[string]any{"role": "assistant", "reasoning": text}, nil
	}
	return nil, fmt.Errorf("unsupported input item type %q (want message, function_call, function_call_output or reasoning)", it.Type)
}

// textParts returns message content with the Responses text parts
// (input_text, output_text) as chat "text" parts: vLLM's chat parser reads
// them as text, and so do both of our renderers then.
func textParts(raw json.RawMessage) any {
	if len(raw) == 0 {
		return nil
	}
	var parts []map[string]json.RawMessage
	if json.Unmarshal(raw, &parts) != nil {
		return raw
	}
	out := make([]any, len(parts))
	for i, p := range parts {
		var typ string
		_ = json.Unmarshal(p["type"], &typ)
		if typ == "input_text" || typ == "output_text" {
			p["type"] = json.RawMessage(`"text"`)
		}
		out[i] = p
	}
	return out
}

func bad(format string, args ...any) error {
	return &prompt.RequestError{Msg: fmt.Sprintf(format, args...)}
}
