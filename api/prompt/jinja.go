package prompt

import (
	"errors"

	"github.com/kvrouter/kvrouter/api/chattemplate"
)

// parseChat compiles the model's own Jinja chat template.
func parseChat(name, src string, special map[string]any) (chatRenderer, error) {
	t, err := chattemplate.Parse(name, src)
	if err != nil {
		return nil, err
	}
	return &jinjaChat{tmpl: t, format: t.ContentFormat(), special: special}, nil
}

// jinjaChat renders with the model's own Jinja chat template.
type jinjaChat struct {
	tmpl    *chattemplate.Template
	format  string         // content format the template expects ("string" or "openai")
	special map[string]any // bos_token, eos_token, … as template variables
}

func (j *jinjaChat) render(body []byte) (string, error) {
	vars, err := chattemplate.Conversation(body, j.format)
	if err != nil {
		return "", badRequest("%v", err)
	}
	for k, v := range j.special {
		if _, set := vars[k]; !set { // chat_template_kwargs win, as in transformers
			vars[k] = v
		}
	}
	text, err := j.tmpl.Render(vars)
	if err != nil {
		var raised *chattemplate.RaisedError
		if errors.As(err, &raised) {
			return "", &RequestError{Msg: raised.Message}
		}
		return "", badRequest("chat template: %v", err)
	}
	return text, nil
}
