package chattemplate

import (
	"fmt"
	"strings"
)

// Conversation turns an OpenAI chat completions request body into the
// template variables exactly as vLLM builds them before apply_chat_template
// (vllm/entrypoints/chat_utils.py parse_chat_messages, the request defaults
// of ChatCompletionRequest, ChatParams' kwargs merge and transformers'
// apply_chat_template), for a template of the given content format
// (Template.ContentFormat):
//
//   - messages: role, content (string format: text parts joined with "\n",
//     null content ""; openai format: a list of {"type": "text", "text": ...},
//     null content []), then tool_calls for assistants (function.arguments
//     JSON strings parsed to objects, invalid ones to {}; an empty list is
//     dropped), reasoning and reasoning_content (from "reasoning"),
//     tool_call_id for tools (list content flattened to a string), name, task;
//   - tools: each {"type", "function": {"name", "description", "parameters",
//     ...}} with absent fields null (pydantic's model_dump), or nil;
//   - documents (nil when absent), add_generation_prompt (default true),
//     continue_final_message (default false; read by Render, hidden from the
//     template), reasoning_effort when given;
//   - chat_template_kwargs, under the fields above (a request field that is
//     set wins over a kwarg of the same name, as vLLM's merge_kwargs does).
//
// Image, audio and video parts are an error: their placeholders depend on
// the model's processor. Special tokens (bos_token, ...) are not part of the
// request: the caller adds them beneath these variables. Errors wrap
// ErrInvalidRequest.
func Conversation(body []byte, format string) (map[string]any, error) {
	if format != FormatString && format != FormatOpenAI {
		return nil, fmt.Errorf("chattemplate: unknown content format %q", format)
	}
	parsed, err := decodeJSON(body)
	if err != nil {
		return nil, invalid("request body: %v", err)
	}
	req, ok := parsed.(*Object)
	if !ok {
		return nil, invalid("request body is not a JSON object")
	}

	rawMsgs, _ := req.Get("messages")
	list, ok := rawMsgs.([]any)
	if !ok {
		return nil, invalid("messages: want a list")
	}
	messages := make([]any, 0, len(list))
	for i, m := range list {
		msg, err := parseMessage(m, format)
		if err != nil {
			return nil, fmt.Errorf("messages[%d]: %w", i, err)
		}
		messages = append(messages, msg)
	}

	tools, err := parseTools(req)
	if err != nil {
		return nil, err
	}

	addGen, err := boolField(req, "add_generation_prompt", true)
	if err != nil {
		return nil, err
	}
	cont, err := boolField(req, "continue_final_message", false)
	if err != nil {
		return nil, err
	}
	if v, _ := req.Get("add_generation_prompt"); cont && v == true {
		return nil, invalid("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
	}

	vars := map[string]any{}
	if kw, _ := req.Get("chat_template_kwargs"); kw != nil {
		kwargs, ok := kw.(*Object)
		if !ok {
			return nil, invalid("chat_template_kwargs: want an object")
		}
		for _, k := range kwargs.Keys() {
			v, _ := kwargs.Get(k)
			switch k {
			case "chat_template", "tokenize":
				return nil, invalid("Found unexpected chat template kwargs from request: {'%s'}", k)
			case "messages", "conversation", "tools":
				// apply_chat_template gets these twice and fails.
				return nil, invalid("chat_template_kwargs: %q is already an argument of apply_chat_template", k)
			case "padding", "truncation", "max_length", "return_tensors", "return_dict",
				"return_assistant_tokens_mask", "tokenizer_kwargs":
				continue // apply_chat_template's own arguments, never seen by the template
			}
			vars[k] = v
		}
	}

	documents, _ := req.Get("documents")
	if documents != nil {
		if err := checkDocuments(documents); err != nil {
			return nil, err
		}
		vars["documents"] = documents
	} else if _, ok := vars["documents"]; !ok {
		vars["documents"] = nil
	}
	if effort, _ := req.Get("reasoning_effort"); effort != nil {
		s, ok := effort.(string)
		if !ok || (s != "low" && s != "medium" && s != "high") {
			return nil, invalid("reasoning_effort: want low, medium or high")
		}
		vars["reasoning_effort"] = s
	}
	vars["add_generation_prompt"] = addGen
	vars["continue_final_message"] = cont
	vars["messages"] = messages
	vars["tools"] = tools
	return vars, nil
}

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalidRequest, fmt.Sprintf(format, args...))
}

func boolField(req *Object, key string, def bool) (bool, error) {
	v, ok := req.Get(key)
	if !ok || v == nil {
		return def, nil
	}
	b, isBool := v.(bool)
	if !isBool {
		return false, invalid("%s: want a boolean", key)
	}
	return b, nil
}

// parseMessage is vLLM's _parse_chat_message_content plus the
// _postprocess_messages step for one message.
func parseMessage(m any, format string) (*Object, error) {
	in, ok := m.(*Object)
	if !ok {
		return nil, invalid("want an object")
	}
	roleV, _ := in.Get("role")
	role, ok := roleV.(string)
	if !ok {
		return nil, invalid("role: want a string")
	}
	contentV, _ := in.Get("content")
	texts, err := contentTexts(contentV)
	if err != nil {
		return nil, err
	}

	out := NewObject()
	out.Set("role", role)
	if format == FormatOpenAI {
		parts := make([]any, len(texts))
		for i, t := range texts {
			p := NewObject()
			p.Set("type", "text")
			p.Set("text", t)
			parts[i] = p
		}
		out.Set("content", parts)
	} else {
		out.Set("content", strings.Join(texts, "\n"))
	}

	switch role {
	case "assistant":
		if tc, ok := in.Get("tool_calls"); ok && tc != nil {
			calls, err := toolCalls(tc)
			if err != nil {
				return nil, err
			}
			if len(calls) > 0 {
				out.Set("tool_calls", calls)
			}
		}
		if r, _ := in.Get("reasoning"); r != nil {
			s, ok := r.(string)
			if !ok {
				return nil, invalid("reasoning: want a string")
			}
			out.Set("reasoning", s)
			out.Set("reasoning_content", s)
		}
	case "tool":
		if id, ok := in.Get("tool_call_id"); ok {
			out.Set("tool_call_id", id)
		}
		// Tool results given as text parts are flattened even for
		// openai-format templates: most templates read tool content as a string.
		if format == FormatOpenAI {
			out.Set("content", strings.Join(texts, "\n"))
		}
	}
	if name, ok := in.Get("name"); ok {
		if s, isStr := name.(string); isStr {
			out.Set("name", s)
		}
	}
	if task, ok := in.Get("task"); ok {
		if s, isStr := task.(string); isStr {
			out.Set("task", s)
		}
	}
	if role == "developer" {
		tools, _ := in.Get("tools")
		out.Set("tools", tools)
	}
	return out, nil
}

// textPartTypes are the part types vLLM treats as text, with the field
// that holds it.
var textPartTypes = map[string]string{
	"text": "text", "input_text": "text", "output_text": "text",
	"refusal": "refusal", "thinking": "thinking",
}

// contentTexts returns the text of each content part in order, skipping
// text and refusal parts whose text is null, as vLLM does.
func contentTexts(content any) ([]string, error) {
	switch c := content.(type) {
	case nil:
		return nil, nil
	case string:
		return []string{c}, nil
	case []any:
		texts := make([]string, 0, len(c))
		for i, p := range c {
			if s, ok := p.(string); ok {
				texts = append(texts, s)
				continue
			}
			part, ok := p.(*Object)
			if !ok {
				return nil, invalid("content[%d]: want a string or an object", i)
			}
			typV, hasType := part.Get("type")
			typ, _ := typV.(string)
			if !hasType || typV == nil {
				return nil, invalid("content[%d]: Missing 'type' field in multimodal part.", i)
			}
			field, isText := textPartTypes[typ]
			if !isText {
				return nil, invalid("content[%d]: unsupported content part type %q (only text parts can be rendered without the model's processor)", i, typ)
			}
			v, _ := part.Get(field)
			if v == nil {
				if typ == "text" || typ == "refusal" {
					continue
				}
				return nil, invalid("content[%d]: %s part without %s", i, typ, field)
			}
			s, ok := v.(string)
			if !ok {
				return nil, invalid("content[%d].%s: want a string", i, field)
			}
			texts = append(texts, s)
		}
		return texts, nil
	}
	return nil, invalid("content: want a string, a list of parts or null")
}

// toolCalls copies an assistant's tool_calls, parsing each
// function.arguments JSON string to a value as vLLM does for transformers
// (invalid JSON and non-container values become {}).
func toolCalls(v any) ([]any, error) {
	list, ok := v.([]any)
	if !ok {
		return nil, invalid("tool_calls: want a list")
	}
	out := make([]any, len(list))
	for i, item := range list {
		call, ok := item.(*Object)
		if !ok {
			return nil, invalid("tool_calls[%d]: want an object", i)
		}
		fnV, _ := call.Get("function")
		fn, ok := fnV.(*Object)
		if !ok {
			return nil, invalid("tool_calls[%d].function: want an object", i)
		}
		fn = fn.clone()
		args, _ := fn.Get("arguments")
		switch a := args.(type) {
		case string:
			parsed, err := decodeJSON([]byte(a))
			if err != nil {
				parsed = NewObject()
			}
			fn.Set("arguments", parsed)
		case *Object, []any:
		default:
			fn.Set("arguments", NewObject())
		}
		call = call.clone()
		call.Set("function", fn)
		out[i] = call
	}
	return out, nil
}

// parseTools is [tool.model_dump() for tool in request.tools]: declared
// fields first, with null for the absent ones, then extra fields.
func parseTools(req *Object) (any, error) {
	v, _ := req.Get("tools")
	if v == nil {
		return nil, nil
	}
	list, ok := v.([]any)
	if !ok {
		return nil, invalid("tools: want a list")
	}
	out := make([]any, len(list))
	for i, item := range list {
		in, ok := item.(*Object)
		if !ok {
			return nil, invalid("tools[%d]: want an object", i)
		}
		if typ, ok := in.Get("type"); ok && typ != "function" {
			return nil, invalid("tools[%d].type: want \"function\"", i)
		}
		fnV, _ := in.Get("function")
		fnIn, ok := fnV.(*Object)
		if !ok {
			return nil, invalid("tools[%d].function: want an object", i)
		}
		name, _ := fnIn.Get("name")
		if _, ok := name.(string); !ok {
			return nil, invalid("tools[%d].function.name: want a string", i)
		}
		fn := NewObject()
		fn.Set("name", name)
		desc, _ := fnIn.Get("description")
		if _, ok := desc.(string); desc != nil && !ok {
			return nil, invalid("tools[%d].function.description: want a string", i)
		}
		fn.Set("description", desc)
		params, _ := fnIn.Get("parameters")
		if _, ok := params.(*Object); params != nil && !ok {
			return nil, invalid("tools[%d].function.parameters: want an object", i)
		}
		fn.Set("parameters", params)
		for _, k := range fnIn.Keys() {
			if _, declared := fn.Get(k); !declared {
				x, _ := fnIn.Get(k)
				fn.Set(k, x)
			}
		}
		tool := NewObject()
		tool.Set("type", "function")
		tool.Set("function", fn)
		for _, k := range in.Keys() {
			if k != "type" && k != "function" {
				x, _ := in.Get(k)
				tool.Set(k, x)
			}
		}
		out[i] = tool
	}
	return out, nil
}

// checkDocuments enforces list[dict[str, str]].
func checkDocuments(v any) error {
	list, ok := v.([]any)
	if !ok {
		return invalid("documents: want a list of objects")
	}
	for i, d := range list {
		doc, ok := d.(*Object)
		if !ok {
			return invalid("documents[%d]: want an object", i)
		}
		for _, k := range doc.Keys() {
			if x, _ := doc.Get(k); x != nil {
				if _, isStr := x.(string); isStr {
					continue
				}
			}
			return invalid("documents[%d].%s: want a string", i, k)
		}
	}
	return nil
}
