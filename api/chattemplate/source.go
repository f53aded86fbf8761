package chattemplate

import (
	"fmt"
	"strings"
)

// tojsonFilter is the name HF's tojson is registered under. The engine's
// builtin filters cannot be replaced, and its own tojson differs from
// json.dumps (1.0 prints as 1, U+2028 is escaped, indent sorts keys), so
// prepare renames `| tojson` in the source to this scope-resolved filter.
const tojsonFilter = "__kvrouter_tojson"

// supportedFilters are the builtin filters whose output we checked against
// Python jinja2 (plus tojson, which is ours). Others fail in Parse: a
// filter that renders almost like Python's would silently change prompts.
var supportedFilters = map[string]bool{
	"tojson": true, "trim": true, "length": true, "count": true, "join": true,
	"safe": true, "string": true, "list": true, "selectattr": true,
	"rejectattr": true, "map": true, "first": true, "last": true,
	"default": true, "d": true, "lower": true, "upper": true, "items": true,
	"reverse": true, "replace": true, "int": true, "dictsort": true,
	"select": true, "reject": true, "unique": true, "sort": true, "sum": true,
	"abs": true, "min": true, "max": true, "capitalize": true,
}

// supportedTests are the `is` tests the engine evaluates as jinja2 does for
// the values a template sees. Notably absent: "sequence" (the engine says
// false for strings and dicts, Python says true).
var supportedTests = map[string]bool{
	"defined": true, "undefined": true, "none": true, "boolean": true,
	"integer": true, "float": true, "number": true, "string": true,
	"mapping": true, "iterable": true, "callable": true, "true": true,
	"false": true, "odd": true, "even": true, "eq": true, "equalto": true,
	"ne": true, "gt": true, "ge": true, "lt": true, "le": true, "in": true,
	"greaterthan": true, "lessthan": true, "sameas": true,
}

// prepare turns a chat template into the source the engine compiles,
// making up for what jinja2 does before parsing and what the engine cannot
// be configured to do:
//   - newlines are normalised to "\n" and one trailing newline is dropped
//     (jinja2's lexer with keep_trailing_newline=False);
//   - `| tojson` becomes `| __kvrouter_tojson` (see tojsonFilter);
//   - transformers' {% generation %} tag, which only marks assistant spans
//     for training masks, becomes {% if true %}, so its whitespace control
//     behaves the same.
//
// It rejects what we cannot render exactly, naming the feature.
func prepare(src string) (string, error) {
	src = strings.ReplaceAll(src, "\r\n", "\n")
	src = strings.ReplaceAll(src, "\r", "\n")
	src = strings.TrimSuffix(src, "\n")

	var out strings.Builder
	out.Grow(len(src) + 64)
	for i := 0; i < len(src); {
		open := strings.Index(src[i:], "{")
		if open < 0 || i+open+1 >= len(src) {
			out.WriteString(src[i:])
			break
		}
		open += i
		kind := src[open+1]
		if kind != '{' && kind != '%' && kind != '#' {
			out.WriteString(src[i : open+1])
			i = open + 1
			continue
		}
		out.WriteString(src[i:open])
		if kind == '#' {
			end := strings.Index(src[open:], "#}")
			if end < 0 {
				return "", fmt.Errorf("unterminated comment at offset %d", open)
			}
			out.WriteString(src[open : open+end+2])
			i = open + end + 2
			continue
		}
		closer := "}}"
		if kind == '%' {
			closer = "%}"
		}
		end, err := tagEnd(src, open+2, closer)
		if err != nil {
			return "", err
		}
		body := src[open+2 : end]
		if strings.HasPrefix(body, "+") || strings.HasSuffix(body, "+") {
			return "", fmt.Errorf("unsupported: the '+' whitespace modifier in %q", src[open:end+2])
		}
		body, err = rewriteTag(body, kind == '%')
		if err != nil {
			return "", fmt.Errorf("%w in %q", err, src[open:end+2])
		}
		out.WriteString(src[open : open+2])
		out.WriteString(body)
		out.WriteString(closer)
		i = end + 2
	}
	return out.String(), nil
}

// tagEnd finds the closer of a tag starting at from, skipping string
// literals (a "}}" inside quotes does not end the tag).
func tagEnd(src string, from int, closer string) (int, error) {
	for j := from; j < len(src); j++ {
		switch c := src[j]; c {
		case '\'', '"':
			k := j + 1
			for ; k < len(src) && src[k] != c; k++ {
				if src[k] == '\\' {
					k++
				}
			}
			j = k
		default:
			if strings.HasPrefix(src[j:], closer) {
				return j, nil
			}
		}
	}
	return 0, fmt.Errorf("unterminated tag at offset %d", from-2)
}

// rewriteTag renames tojson, maps the generation tag and checks filter
// and test names in one tag body.
func rewriteTag(body string, statement bool) (string, error) {
	toks := lexTag(body)
	if statement {
		if kw := firstWord(toks); kw == "raw" || kw == "call" || kw == "include" || kw == "import" || kw == "from" || kw == "extends" || kw == "block" {
			return "", fmt.Errorf("unsupported: the {%% %s %%} statement", kw)
		}
	}
	var out strings.Builder
	for n, t := range toks {
		text := t.text
		prev := prevSignificant(toks, n)
		switch {
		case statement && t.kind == tokName && prev < 0 && t.text == "generation":
			text = "if true"
		case statement && t.kind == tokName && prev < 0 && t.text == "endgeneration":
			text = "endif"
		case t.kind == tokName && prev >= 0 && toks[prev].text == "|":
			if !supportedFilters[t.text] {
				return "", fmt.Errorf("unsupported: the %q filter", t.text)
			}
			if t.text == "tojson" {
				text = tojsonFilter
			}
		case t.kind == tokName && t.text != "not" && prev >= 0 && isTestPosition(toks, prev):
			if !supportedTests[t.text] {
				return "", fmt.Errorf("unsupported: the %q test", t.text)
			}
		}
		out.WriteString(text)
	}
	return out.String(), nil
}

// isTestPosition reports whether the name after toks[prev] is a test name:
// it follows "is" or "is not".
func isTestPosition(toks []tagToken, prev int) bool {
	if toks[prev].kind != tokName {
		return false
	}
	if toks[prev].text == "is" {
		return true
	}
	if toks[prev].text == "not" {
		if p := prevSignificant(toks, prev); p >= 0 && toks[p].text == "is" {
			return true
		}
	}
	return false
}

func firstWord(toks []tagToken) string {
	for _, t := range toks {
		if t.kind == tokSpace || t.text == "-" {
			continue
		}
		return t.text
	}
	return ""
}

func prevSignificant(toks []tagToken, n int) int {
	for p := n - 1; p >= 0; p-- {
		if toks[p].kind == tokSpace || (p == 0 && toks[p].text == "-") {
			continue
		}
		return p
	}
	return -1
}

type tokKind int

const (
	tokSpace tokKind = iota
	tokName
	tokString
	tokOther
)

type tagToken struct {
	kind tokKind
	text string
}

// lexTag splits a tag body into names, string literals, whitespace and
// single other characters; enough to find filter and test names.
func lexTag(body string) []tagToken {
	var toks []tagToken
	for i := 0; i < len(body); {
		c := body[i]
		switch {
		case c == ' ' || c == '\t' || c == '\n':
			j := i
			for j < len(body) && (body[j] == ' ' || body[j] == '\t' || body[j] == '\n') {
				j++
			}
			toks = append(toks, tagToken{tokSpace, body[i:j]})
			i = j
		case c == '\'' || c == '"':
			j := i + 1
			for ; j < len(body) && body[j] != c; j++ {
				if body[j] == '\\' {
					j++
				}
			}
			j = min(j+1, len(body))
			toks = append(toks, tagToken{tokString, body[i:j]})
			i = j
		case c == '_' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z':
			j := i
			for j < len(body) && (body[j] == '_' || body[j] >= 'a' && body[j] <= 'z' || body[j] >= 'A' && body[j] <= 'Z' || body[j] >= '0' && body[j] <= '9') {
				j++
			}
			toks = append(toks, tagToken{tokName, body[i:j]})
			i = j
		case c >= '0' && c <= '9':
			j := i
			for j < len(body) && (body[j] >= '0' && body[j] <= '9' || body[j] == '.' || body[j] == '_') {
				j++
			}
			toks = append(toks, tagToken{tokOther, body[i:j]})
			i = j
		default:
			toks = append(toks, tagToken{tokOther, body[i : i+1]})
			i++
		}
	}
	return toks
}
