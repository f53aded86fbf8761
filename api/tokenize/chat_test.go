package tokenize

import (
	"encoding/json"
	"testing"
)

func TestRenderChat(t *testing.T) {
	msgs := []Message{{Role: "system", Content: "Be brief."}, {Role: "user", Content: "Hi"}}
	tests := []struct {
		tmpl Template
		gen  bool
		want string
	}{
		{ChatML, true, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"},
		{ChatML, false, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"},
		{Plain, true, "system: Be brief.\nuser: Hi\nassistant:"},
		{Plain, false, "system: Be brief.\nuser: Hi\n"},
	}
	for _, tt := range tests {
		got, err := RenderChat(msgs, tt.tmpl, tt.gen)
		if err != nil || got != tt.want {
			t.Errorf("RenderChat(%v, gen=%v) = %q, %v; want %q", tt.tmpl, tt.gen, got, err, tt.want)
		}
	}
	var zero Template
	if zero != ChatML {
		t.Error("zero Template is not ChatML")
	}
	if got, _ := RenderChat(nil, ChatML, true); got != "<|im_start|>assistant\n" {
		t.Errorf("no messages: %q", got)
	}
	if _, err := RenderChat([]Message{{Content: "x"}}, ChatML, false); err == nil {
		t.Error("empty role accepted")
	}
	if _, err := RenderChat(msgs, Template(9), false); err == nil {
		t.Error("unknown template accepted")
	}
}

func TestParseTemplate(t *testing.T) {
	for _, tmpl := range []Template{ChatML, Plain} {
		if got, err := ParseTemplate(tmpl.String()); err != nil || got != tmpl {
			t.Errorf("ParseTemplate(%q) = %v, %v", tmpl.String(), got, err)
		}
	}
	for name, want := range map[string]Template{"": ChatML, "ChatML": ChatML, "PLAIN": Plain} {
		if got, err := ParseTemplate(name); err != nil || got != want {
			t.Errorf("ParseTemplate(%q) = %v, %v", name, got, err)
		}
	}
	if _, err := ParseTemplate("jinja"); err == nil {
		t.Error("unknown name accepted")
	}
}

func TestContentText(t *testing.T) {
	tests := []struct {
		raw     string
		want    string
		wantErr bool
	}{
		{`"hello"`, "hello", false},
		{`""`, "", false},
		{`null`, "", false},
		{``, "", false},
		{`[]`, "", false},
		{`[{"type":"text","text":"a"}]`, "a", false},
		{`[{"type":"text","text":"a"},{"type":"text","text":"b"}]`, "a\nb", false},
		{` [ {"type": "text", "text": "x\ny"} ] `, "x\ny", false},
		{`[{"type":"image_url","image_url":{"url":"http://x"}}]`, "", true},
		{`[{"type":"text"}]`, "", true},
		{`[{"type":"text","text":5}]`, "", true},
		{`42`, "", true},
		{`{"text":"a"}`, "", true},
		{`"unterminated`, "", true},
	}
	for _, tt := range tests {
		got, err := ContentText(json.RawMessage(tt.raw))
		if (err != nil) != tt.wantErr || got != tt.want {
			t.Errorf("ContentText(%s) = %q, %v; want %q, err=%v", tt.raw, got, err, tt.want, tt.wantErr)
		}
	}
}

func TestMessageJSON(t *testing.T) {
	var msgs []Message
	body := `[{"role":"system","content":"s"},
	          {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
	          {"role":"assistant","content":null,"tool_calls":[]}]`
	if err := json.Unmarshal([]byte(body), &msgs); err != nil {
		t.Fatal(err)
	}
	want := []Message{{"system", "s"}, {"user", "a\nb"}, {"assistant", ""}}
	if len(msgs) != len(want) {
		t.Fatalf("got %v", msgs)
	}
	for i := range want {
		if msgs[i] != want[i] {
			t.Errorf("msg %d = %+v, want %+v", i, msgs[i], want[i])
		}
	}
	var m Message
	if err := json.Unmarshal([]byte(`{"role":"user","content":[{"type":"input_audio"}]}`), &m); err == nil {
		t.Error("audio part accepted")
	}
	// Marshalling writes plain string content.
	out, err := json.Marshal(Message{Role: "user", Content: "hi"})
	if err != nil || string(out) != `{"role":"user","content":"hi"}` {
		t.Errorf("Marshal = %s, %v", out, err)
	}
}
