package chattemplate

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"
)

func TestChatTemplatePyFloatRepr(t *testing.T) {
	for _, c := range []struct {
		f    float64
		want string
	}{
		{1, "1.0"}, {-0.0 * -1, "0.0"}, {math.Copysign(0, -1), "-0.0"}, {0.1, "0.1"},
		{1e-4, "0.0001"}, {1e-5, "1e-05"}, {1e16, "1e+16"}, {9999999999999998, "9999999999999998.0"},
		{123456.789, "123456.789"}, {1.5e300, "1.5e+300"}, {0.30000000000000004, "0.30000000000000004"},
	} {
		if got := pyFloatRepr(c.f); got != c.want {
			t.Errorf("pyFloatRepr(%v) = %q, want %q", c.f, got, c.want)
		}
	}
}

func TestChatTemplateContentFormat(t *testing.T) {
	for _, c := range []struct{ src, want string }{
		{"{% for m in messages %}{{ m.content }}{% endfor %}", FormatString},
		{"{% for m in messages %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}", FormatOpenAI},
		{"{% for m in messages %}{% for c in m['content'] | selectattr('type', 'equalto', 'text') %}{% endfor %}{% endfor %}", FormatOpenAI},
		{"{% set loop_messages = messages[1:] %}{% for message in loop_messages %}{%- for item in message['content'] -%}{% endfor %}{% endfor %}", FormatOpenAI},
		{"{% set x = messages %}{% set y = x|reverse %}{% for m in y %}{% for c in m.content[1:] %}{% endfor %}{% endfor %}", FormatOpenAI},
		{"{% for m in messages if m.role == 'user' %}{% for c in m.content %}{% endfor %}{% endfor %}", FormatOpenAI},
		{"{% for c in messages[0].content %}{% endfor %}", FormatString},
		{"{% for m in messages[1:] if m.role %}{% for k, v in m.content %}{% endfor %}{% endfor %}", FormatString},
	} {
		tpl, err := Parse("t", c.src)
		if err != nil {
			t.Fatalf("Parse(%q): %v", c.src, err)
		}
		if got := tpl.ContentFormat(); got != c.want {
			t.Errorf("ContentFormat(%q) = %s, want %s", c.src, got, c.want)
		}
	}
}

func TestChatTemplateParseRejectsInexactFeatures(t *testing.T) {
	for _, c := range []struct{ src, feature string }{
		{"{{ x | title }}", `"title" filter`},
		{"{{ x | indent(2) }}", `"indent" filter`},
		{"{% if x is sequence %}{% endif %}", `"sequence" test`},
		{"a {%+ if x %}b{% endif %}", "'+' whitespace modifier"},
		{"{% raw %}{{ x }}{% endraw %}", "raw"},
	} {
		_, err := Parse("t", c.src)
		if err == nil || !strings.Contains(err.Error(), c.feature) {
			t.Errorf("Parse(%q) = %v, want an error naming %s", c.src, err, c.feature)
		}
	}
	// The same words inside string literals are text, not features.
	if _, err := Parse("t", `{{ 'x | title' ~ "is sequence" }}`); err != nil {
		t.Errorf("string literal mistaken for a filter: %v", err)
	}
}

func TestChatTemplateRenderBasics(t *testing.T) {
	src := "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content | trim }}\n{% endfor %}" +
		"{% if tools is not none %}{{ tools | tojson }}{% endif %}{{ strftime_now('%d %b %Y') }}\n"
	tpl, err := Parse("t", src)
	if err != nil {
		t.Fatal(err)
	}
	tpl = tpl.WithClock(func() time.Time { return time.Date(2024, 7, 26, 0, 0, 0, 0, time.UTC) })
	vars, err := Conversation([]byte(`{"messages":[{"role":"user","content":" hi "}],
		"tools":[{"type":"function","function":{"name":"f","parameters":{"b":1.0,"a":"é"}}}]}`), tpl.ContentFormat())
	if err != nil {
		t.Fatal(err)
	}
	vars["bos_token"] = "<s>"
	got, err := tpl.Render(vars)
	if err != nil {
		t.Fatal(err)
	}
	want := `<s>user: hi
[{"type": "function", "function": {"name": "f", "description": null, "parameters": {"b": 1.0, "a": "é"}}}]26 Jul 2024`
	if got != want {
		t.Errorf("got  %q\nwant %q", got, want)
	}
}

func TestChatTemplateRaiseException(t *testing.T) {
	tpl, err := Parse("t", "{% if messages[0].role != 'user' %}{{ raise_exception('Roles must start with user') }}{% endif %}ok")
	if err != nil {
		t.Fatal(err)
	}
	vars, _ := Conversation([]byte(`{"messages":[{"role":"assistant","content":"x"}]}`), FormatString)
	_, err = tpl.Render(vars)
	var raised *RaisedError
	if !errors.As(err, &raised) || raised.Message != "Roles must start with user" {
		t.Fatalf("Render error = %v, want RaisedError", err)
	}
}

func TestChatTemplateConversation(t *testing.T) {
	body := `{"messages":[
		{"role":"system","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
		{"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{\"z\": 1, \"a\": [2.5]}"}}],"reasoning":"r"},
		{"role":"assistant","content":"x","tool_calls":[]},
		{"role":"tool","tool_call_id":"1","content":[{"type":"text","text":"t1"},{"type":"text","text":"t2"}]}],
		"chat_template_kwargs":{"enable_thinking":false,"add_generation_prompt":false},
		"documents":[{"title":"T","text":"B"}]}`
	for _, format := range []string{FormatString, FormatOpenAI} {
		vars, err := Conversation([]byte(body), format)
		if err != nil {
			t.Fatal(err)
		}
		got, err := pyDumps(plainData(vars), newDumpOptions())
		if err != nil {
			t.Fatal(err)
		}
		want := map[string]string{
			FormatString: `{"add_generation_prompt": true, "continue_final_message": false, "documents": [{"title": "T", "text": "B"}], "enable_thinking": false, "messages": [{"role": "system", "content": "a\nb"}, {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {"z": 1, "a": [2.5]}}}], "reasoning": "r", "reasoning_content": "r"}, {"role": "assistant", "content": "x"}, {"role": "tool", "content": "t1\nt2", "tool_call_id": "1"}], "tools": null}`,
			FormatOpenAI: `{"add_generation_prompt": true, "continue_final_message": false, "documents": [{"title": "T", "text": "B"}], "enable_thinking": false, "messages": [{"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, {"role": "assistant", "content": [], "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {"z": 1, "a": [2.5]}}}], "reasoning": "r", "reasoning_content": "r"}, {"role": "assistant", "content": [{"type": "text", "text": "x"}]}, {"role": "tool", "content": "t1\nt2", "tool_call_id": "1"}], "tools": null}`,
		}[format]
		if got != want {
			t.Errorf("%s:\ngot  %s\nwant %s", format, got, want)
		}
	}
	for _, bad := range []string{
		`{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}`,
		`{"messages":[{"role":"user","content":"x"}],"continue_final_message":true,"add_generation_prompt":true}`,
		`{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"tokenize":true}}`,
		`{"messages":"x"}`,
	} {
		if _, err := Conversation([]byte(bad), FormatString); !errors.Is(err, ErrInvalidRequest) {
			t.Errorf("Conversation(%s) = %v, want ErrInvalidRequest", bad, err)
		}
	}
}

func TestChatTemplateContinueFinalMessage(t *testing.T) {
	tpl, err := Parse("t", "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}")
	if err != nil {
		t.Fatal(err)
	}
	vars, err := Conversation([]byte(`{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"The answer  "}],
		"continue_final_message":true,"add_generation_prompt":false}`), tpl.ContentFormat())
	if err != nil {
		t.Fatal(err)
	}
	got, err := tpl.Render(vars)
	if err != nil {
		t.Fatal(err)
	}
	if want := "<user>q</user><assistant>The answer"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
	// The default add_generation_prompt (true) conflicts, as in transformers.
	vars, _ = Conversation([]byte(`{"messages":[{"role":"assistant","content":"x"}],"continue_final_message":true}`), FormatString)
	if _, err := tpl.Render(vars); !errors.Is(err, ErrInvalidRequest) {
		t.Errorf("continue with default add_generation_prompt: %v, want ErrInvalidRequest", err)
	}
}

// FuzzChatTemplate: Parse and Render must not panic on any template or
// request; errors are fine.
func FuzzChatTemplate(f *testing.F) {
	f.Add("{% for m in messages %}{{ m.content | trim }}{% endfor %}", `{"messages":[{"role":"user","content":"hi"}]}`)
	f.Add("{{ tools | tojson(indent=2) }}{{ raise_exception('x') }}", `{"messages":[],"tools":[{"type":"function","function":{"name":"f"}}]}`)
	f.Add("{% set ns = namespace(a=1) %}{{ messages[::-1][0].content.split('x')[-1].lstrip() }}", `{"messages":[{"role":"user","content":"axb"}],"continue_final_message":true,"add_generation_prompt":false}`)
	f.Fuzz(func(t *testing.T, src, body string) {
		tpl, err := Parse("fuzz", src)
		if err != nil {
			return
		}
		_ = tpl.ContentFormat()
		vars, err := Conversation([]byte(body), tpl.ContentFormat())
		if err != nil {
			return
		}
		_, _ = tpl.Render(vars)
	})
}

// BenchmarkRender: a typical 4-turn request with a system prompt on the
// Qwen2.5-style ChatML template.
func BenchmarkRender(b *testing.B) {
	src := "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}" +
		"{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
	tpl, err := Parse("chatml", src)
	if err != nil {
		b.Fatal(err)
	}
	body := []byte(`{"messages":[{"role":"system","content":"You are a helpful assistant."},
		{"role":"user","content":"What is the capital of France?"},{"role":"assistant","content":"Paris."},
		{"role":"user","content":"And of Germany? Please answer in one word and explain how you know."},
		{"role":"assistant","content":"Berlin. It has been the capital since reunification in 1990."},
		{"role":"user","content":"Thanks! Now list three more European capitals with their countries."}]}`)
	vars, err := Conversation(body, tpl.ContentFormat())
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := tpl.Render(vars); err != nil {
			b.Fatal(err)
		}
	}
}
