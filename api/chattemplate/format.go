package chattemplate

import "strings"

// Content formats, as vLLM names them.
const (
	FormatString = "string" // message content is one string
	FormatOpenAI = "openai" // message content is a list of {"type": ..., ...} parts
)

// detectContentFormat follows vLLM's _detect_content_format: the format is
// "openai" when some {% for %} loop iterates over the content of a message,
// where a message is the target of a loop over `messages` or over a
// variable assigned from it ({% set loop_messages = messages[1:] %}), and
// "string" otherwise. Like vLLM's AST walk it looks through filters, tests
// and slices (`messages|reverse`, `message['content'][1:]`), and anything it
// cannot follow (vLLM's assertion failures) yields "string", vLLM's default.
func detectContentFormat(src string) string {
	type stmt struct {
		kind   string // "set" or "for"
		target []tagToken
		expr   []tagToken
	}
	var stmts []stmt
	prepared := strings.ReplaceAll(src, "\r\n", "\n")
	for i := 0; i < len(prepared); {
		open := strings.Index(prepared[i:], "{%")
		if open < 0 {
			break
		}
		open += i
		end, err := tagEnd(prepared, open+2, "%}")
		if err != nil {
			break
		}
		body := strings.Trim(prepared[open+2:end], "-+")
		i = end + 2
		toks := significant(lexTag(body))
		if len(toks) < 4 {
			continue
		}
		switch toks[0].text {
		case "set":
			eq := indexOf(toks, "=")
			if eq < 0 {
				continue // block set: {% set x %}...{% endset %}
			}
			stmts = append(stmts, stmt{"set", toks[1:eq], toks[eq+1:]})
		case "for":
			in := indexOf(toks, "in")
			if in < 0 {
				continue
			}
			expr := toks[in+1:]
			// `for x in xs if cond` and `recursive`: the iterable ends there.
			if k := indexOfTopLevel(expr, "if"); k >= 0 {
				expr = expr[:k]
			}
			if k := indexOfTopLevel(expr, "recursive"); k >= 0 {
				expr = expr[:k]
			}
			stmts = append(stmts, stmt{"for", toks[1:in], expr})
		}
	}

	// Names that hold messages: BFS over assignments, as vLLM does.
	msgVars := []string{"messages"}
	seen := map[string]bool{"messages": true}
	for q := 0; q < len(msgVars); q++ {
		for _, s := range stmts {
			if s.kind != "set" || !isVarOrElemsAccess(s.expr, msgVars[q], "") {
				continue
			}
			if len(s.target) != 1 || s.target[0].kind != tokName {
				return FormatString // vLLM: assertion on a non-Name target
			}
			if name := s.target[0].text; !seen[name] {
				seen[name] = true
				msgVars = append(msgVars, name)
			}
		}
	}
	var messageVars []string
	for _, s := range stmts {
		if s.kind != "for" {
			continue
		}
		for _, v := range msgVars {
			if isVarOrElemsAccess(s.expr, v, "") {
				if len(s.target) != 1 || s.target[0].kind != tokName {
					return FormatString
				}
				messageVars = append(messageVars, s.target[0].text)
				break
			}
		}
	}
	for _, s := range stmts {
		if s.kind != "for" {
			continue
		}
		for _, m := range messageVars {
			if isVarOrElemsAccess(s.expr, m, "content") {
				if len(s.target) != 1 || s.target[0].kind != tokName {
					return FormatString
				}
				return FormatOpenAI
			}
		}
	}
	return FormatString
}

func significant(toks []tagToken) []tagToken {
	out := toks[:0:0]
	for _, t := range toks {
		if t.kind != tokSpace {
			out = append(out, t)
		}
	}
	return out
}

func indexOf(toks []tagToken, text string) int {
	for i, t := range toks {
		if t.text == text && t.kind != tokString {
			return i
		}
	}
	return -1
}

// indexOfTopLevel finds a keyword outside brackets.
func indexOfTopLevel(toks []tagToken, word string) int {
	depth := 0
	for i, t := range toks {
		switch t.text {
		case "(", "[", "{":
			depth++
		case ")", "]", "}":
			depth--
		}
		if depth == 0 && t.kind == tokName && t.text == word {
			return i
		}
	}
	return -1
}

// isVarOrElemsAccess is vLLM's _is_var_or_elems_access on a token list:
// after peeling filters (`x | f(...)`), a test (`x is t`) and trailing
// slices (`x[1:]`), what is left must be the bare name (key == "") or
// name.key / name['key'].
func isVarOrElemsAccess(expr []tagToken, name, key string) bool {
	// Peel a trailing test: `x is [not] name [args]`.
	if k := indexOfTopLevel(expr, "is"); k > 0 {
		expr = expr[:k]
	}
	// Peel filters: everything from the first top-level '|'.
	depth := 0
	for i, t := range expr {
		switch t.text {
		case "(", "[", "{":
			depth++
		case ")", "]", "}":
			depth--
		case "|":
			if depth == 0 {
				expr = expr[:i]
			}
		}
		if len(expr) == i {
			break
		}
	}
	// Peel trailing slices.
	for len(expr) > 0 && expr[len(expr)-1].text == "]" {
		open := matchingOpen(expr, len(expr)-1)
		if open <= 0 || indexOfTopLevel(expr[open+1:len(expr)-1], ":") < 0 && indexOfColon(expr[open+1:len(expr)-1]) < 0 {
			break
		}
		expr = expr[:open]
	}
	if len(expr) == 0 || expr[0].kind != tokName || expr[0].text != name {
		return false
	}
	rest := expr[1:]
	if key == "" {
		return len(rest) == 0
	}
	switch {
	case len(rest) == 2 && rest[0].text == "." && rest[1].text == key:
		return true
	case len(rest) == 3 && rest[0].text == "[" && rest[2].text == "]" && rest[1].kind == tokString:
		return strings.Trim(rest[1].text, `'"`) == key
	}
	return false
}

// indexOfColon finds a ':' at the top level of a subscript (a slice).
func indexOfColon(toks []tagToken) int {
	depth := 0
	for i, t := range toks {
		switch t.text {
		case "(", "[", "{":
			depth++
		case ")", "]", "}":
			depth--
		case ":":
			if depth == 0 {
				return i
			}
		}
	}
	return -1
}

// matchingOpen returns the index of the '[' closing at close, or -1.
func matchingOpen(toks []tagToken, close int) int {
	depth := 0
	for i := close; i >= 0; i-- {
		switch toks[i].text {
		case "]":
			depth++
		case "[":
			depth--
			if depth == 0 {
				return i
			}
		}
	}
	return -1
}
