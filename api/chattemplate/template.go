// Package chattemplate renders Hugging Face chat templates byte for byte as
// vLLM does through transformers' apply_chat_template, so the router hashes
// the same prompt tokens the worker computes. See DESIGN.md.
package chattemplate

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ardanlabs/jinja"
)

// ErrInvalidRequest marks errors caused by the request (vLLM answers them
// with 400): bad messages, unsupported content parts, conflicting flags.
var ErrInvalidRequest = errors.New("invalid chat request")

// RaisedError is what raise_exception produced (the API answers it as 400
// with this message, as vLLM does).
type RaisedError struct{ Message string }

func (e *RaisedError) Error() string { return e.Message }

// Template is a parsed chat template, safe for concurrent Render calls.
type Template struct {
	name     string
	src      string // as given: continue_final_message checks it, as transformers does
	compiled *jinja.Template
	format   string
	now      func() time.Time
}

// Parse compiles src; a template using something we cannot render exactly
// fails here naming the feature.
func Parse(name, src string) (*Template, error) {
	prepared, err := prepare(src)
	if err != nil {
		return nil, fmt.Errorf("chat template %s: %w", name, err)
	}
	compiled, err := jinja.Compile(prepared)
	if err != nil {
		return nil, fmt.Errorf("chat template %s: %w", name, err)
	}
	return &Template{
		name:     name,
		src:      src,
		compiled: compiled,
		format:   detectContentFormat(src),
		now:      time.Now,
	}, nil
}

// WithClock returns a copy of t whose strftime_now reads now instead of the
// local clock (tests pin it).
func (t *Template) WithClock(now func() time.Time) *Template {
	c := *t
	c.now = now
	return &c
}

// Name is the name given to Parse.
func (t *Template) Name() string { return t.name }

// ContentFormat says whether the template iterates message content as a
// list of parts ("openai") or reads it as a string ("string"), detected from
// the template source the way vLLM's _detect_content_format does.
func (t *Template) ContentFormat() string { return t.format }

// continueTag is what transformers appends to the final message for
// continue_final_message, to find where that message ends in the render.
const continueTag = "CONTINUE_FINAL_MESSAGE_TAG "

// Render renders with vars (messages, tools, documents,
// add_generation_prompt, special tokens, kwargs...) as the template sees
// them. Like apply_chat_template's own argument, vars["continue_final_message"]
// is not shown to the template: when true, the final message's text is
// left open (the render is cut right after it).
//
// Values may be nil, bool, string, int, int64, float64, []any, []string,
// *Object (key order kept) or map[string]any (keys sorted). Errors from
// raise_exception are *RaisedError.
func (t *Template) Render(vars map[string]any) (string, error) {
	data := make(map[string]jinja.Value, len(vars)+3)
	cont := false
	if v, ok := vars["continue_final_message"]; ok {
		b, isBool := v.(bool)
		if !isBool && v != nil {
			return "", fmt.Errorf("%w: continue_final_message must be a bool", ErrInvalidRequest)
		}
		cont = b
	}
	var final string
	for k, v := range vars {
		if k == "continue_final_message" {
			continue
		}
		if k == "messages" && cont {
			var err error
			v, final, err = t.markFinalMessage(v)
			if err != nil {
				return "", err
			}
		}
		jv, err := toJinja(v)
		if err != nil {
			return "", fmt.Errorf("chat template %s: variable %s: %w", t.name, k, err)
		}
		data[k] = jv
	}
	if cont && truthy(vars["add_generation_prompt"]) {
		return "", fmt.Errorf("%w: continue_final_message and add_generation_prompt are not compatible. Use continue_final_message when you want the model to continue the final message, and add_generation_prompt when you want to add a header that will prompt it to start a new assistant message instead", ErrInvalidRequest)
	}
	t.addGlobals(data)

	out, err := t.compiled.RenderValues(data)
	if err != nil {
		var raised *RaisedError
		if errors.As(err, &raised) {
			return "", raised
		}
		return "", fmt.Errorf("chat template %s: %w", t.name, err)
	}
	if cont {
		return cutAtContinueTag(out, final)
	}
	return out, nil
}

// truthy is Python truthiness for the values Render accepts.
func truthy(v any) bool {
	switch x := v.(type) {
	case nil:
		return false
	case bool:
		return x
	case string:
		return x != ""
	case int:
		return x != 0
	case int64:
		return x != 0
	case float64:
		return x != 0
	case []any:
		return len(x) > 0
	case *Object:
		return x.Len() > 0
	case map[string]any:
		return len(x) > 0
	}
	return true
}

// addGlobals sets what transformers adds to the environment. Variables of
// the same name win in jinja2 (render() arguments shadow globals), so only
// missing names are set.
func (t *Template) addGlobals(data map[string]jinja.Value) {
	if _, ok := data["raise_exception"]; !ok {
		data["raise_exception"] = jinja.NewCallable("raise_exception", func(args []jinja.Value, _ map[string]jinja.Value) (jinja.Value, error) {
			if len(args) != 1 {
				return jinja.Undefined(), fmt.Errorf("raise_exception() takes 1 positional argument but %d were given", len(args))
			}
			return jinja.Undefined(), &RaisedError{Message: pyStr(args[0])}
		})
	}
	if _, ok := data["strftime_now"]; !ok {
		now := t.now
		data["strftime_now"] = jinja.NewCallable("strftime_now", func(args []jinja.Value, _ map[string]jinja.Value) (jinja.Value, error) {
			if len(args) != 1 || !args[0].IsString() {
				return jinja.Undefined(), errors.New("strftime_now() takes one format string")
			}
			return jinja.NewString(pyStrftime(now(), args[0].AsString())), nil
		})
	}
	data[tojsonFilter] = jinja.NewCallable("tojson", hfToJSON)
}

// pyStr is str(x) for a raise_exception message.
func pyStr(v jinja.Value) string {
	if v.IsString() {
		return v.AsString()
	}
	return v.String()
}

// hfToJSON is transformers' tojson filter:
// json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False).
func hfToJSON(args []jinja.Value, kwargs map[string]jinja.Value) (jinja.Value, error) {
	if len(args) == 0 {
		return jinja.Undefined(), errors.New("tojson: missing value")
	}
	opt := newDumpOptions()
	names := []string{"ensure_ascii", "indent", "separators", "sort_keys"}
	if len(args)-1 > len(names) {
		return jinja.Undefined(), errors.New("tojson: too many arguments")
	}
	params := map[string]jinja.Value{}
	for i, a := range args[1:] {
		params[names[i]] = a
	}
	for k, v := range kwargs {
		if !strings.Contains(" ensure_ascii indent separators sort_keys ", " "+k+" ") {
			return jinja.Undefined(), fmt.Errorf("tojson() got an unexpected keyword argument '%s'", k)
		}
		params[k] = v
	}
	if v, ok := params["ensure_ascii"]; ok {
		opt.ensureASCII = v.IsTruthy()
	}
	if v, ok := params["sort_keys"]; ok {
		opt.sortKeys = v.IsTruthy()
	}
	if v, ok := params["indent"]; ok && !v.IsNone() {
		opt.hasIndent = true
		opt.itemSep = ","
		switch {
		case v.IsInt():
			opt.indent = strings.Repeat(" ", int(max(v.AsInt(), 0)))
		case v.IsString():
			opt.indent = v.AsString()
		default:
			return jinja.Undefined(), errors.New("tojson: indent must be an int or a string")
		}
	}
	if v, ok := params["separators"]; ok && !v.IsNone() {
		if !v.IsList() || v.AsList().Len() != 2 || !v.AsList().Items[0].IsString() || !v.AsList().Items[1].IsString() {
			return jinja.Undefined(), errors.New("tojson: separators must be two strings")
		}
		opt.itemSep, opt.keySep = v.AsList().Items[0].AsString(), v.AsList().Items[1].AsString()
	}
	x, err := fromJinja(args[0])
	if err != nil {
		return jinja.Undefined(), err
	}
	s, err := pyDumps(x, opt)
	if err != nil {
		return jinja.Undefined(), err
	}
	return jinja.NewString(s), nil
}

// markFinalMessage copies messages with continueTag appended to the final
// message's text, as transformers' render_jinja_template does, and returns
// that text as it was.
func (t *Template) markFinalMessage(v any) (any, string, error) {
	msgs, ok := v.([]any)
	if !ok || len(msgs) == 0 {
		return nil, "", fmt.Errorf("%w: continue_final_message needs at least one message", ErrInvalidRequest)
	}
	last, ok := msgs[len(msgs)-1].(*Object)
	if !ok {
		return nil, "", fmt.Errorf("%w: continue_final_message: final message is %T, not an object", ErrInvalidRequest, msgs[len(msgs)-1])
	}
	content, _ := last.Get("content")
	if content == nil {
		return nil, "", fmt.Errorf(`%w: continue_final_message is set but the final message has no "content" to continue!`, ErrInvalidRequest)
	}
	if !strings.Contains(t.src, "content") {
		return nil, "", fmt.Errorf(`%w: continue_final_message is set to "content" but this is not an accepted field in the chat_template`, ErrInvalidRequest)
	}
	last = last.clone()
	var final string
	switch c := content.(type) {
	case string:
		final = c
		last.Set("content", c+continueTag)
	case []any:
		parts := append([]any(nil), c...)
		found := false
		for i := len(parts) - 1; i >= 0; i-- {
			part, ok := parts[i].(*Object)
			if !ok {
				continue
			}
			text, has := part.Get("text")
			if !has {
				continue
			}
			s, isStr := text.(string)
			if !isStr {
				return nil, "", fmt.Errorf("%w: continue_final_message: final text part is not a string", ErrInvalidRequest)
			}
			part = part.clone()
			part.Set("text", s+continueTag)
			parts[i] = part
			final, found = s, true
			break
		}
		if !found {
			return nil, "", fmt.Errorf("%w: continue_final_message is set but we could not find any text to continue in the final message!", ErrInvalidRequest)
		}
		last.Set("content", parts)
	default:
		return nil, "", fmt.Errorf("%w: continue_final_message: final content is %T", ErrInvalidRequest, content)
	}
	out := append([]any(nil), msgs...)
	out[len(out)-1] = last
	return out, final, nil
}

// cutAtContinueTag ends the render where the final message's text ended.
// If the template trimmed the tag's trailing space (| trim), trailing
// whitespace before the tag goes too: the template would have trimmed it.
func cutAtContinueTag(out, final string) (string, error) {
	bare := strings.TrimSpace(continueTag)
	if !strings.Contains(out, pyStrip(final)) || !strings.Contains(out, bare) {
		return "", fmt.Errorf("%w: continue_final_message is set but the final message does not appear in the chat after applying the chat template! This can happen if the chat template deletes portions of the final message. Please verify the chat template and final message in your chat to ensure they are compatible.", ErrInvalidRequest)
	}
	loc := strings.LastIndex(out, bare)
	if strings.HasPrefix(out[loc:], continueTag) {
		return out[:loc], nil
	}
	return pyRstrip(out[:loc]), nil
}
