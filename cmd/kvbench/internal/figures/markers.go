// Package figures regenerates and checks the tables of BENCHMARKS.md that a
// deterministic kvbench command produces (`kvbench figures`, `make figures`).
//
// A figure is two marked parts of the Markdown file:
//
//	<!-- figure-command: NAME [NAME…] -->
//
//	    kvbench sim … --json out.json     (the next code block: indented or fenced)
//
//	<!-- figure: NAME -->
//	| the table … |
//	<!-- /figure -->
//
// The command block is what a reader sees and runs; kvbench figures runs
// that very text (bash, in a scratch directory, with `kvbench` on PATH
// being the running binary), and a formatter registered under NAME turns
// what it wrote (JSON files, stdout) into the text between the figure
// markers (one command may make several figures). So a printed command cannot drift from the one that made the
// table: the table is checked against the command as printed.
//
// `<!-- figure-file: NAME [NAME…] PATH -->` before a fenced block writes
// that block to PATH in the scratch directory before NAME's command runs (a
// generator script printed in the file).
package figures

import (
	"bytes"
	"fmt"
	"regexp"
	"strings"
)

// Block is one figure's parts as found in the file.
type Block struct {
	Name string
	// Command is the command block's text, indentation or fences removed.
	Command string
	// Files are the figure-file blocks: path in the scratch directory → text.
	Files map[string]string
	// Body is the text between the figure markers (each line with its
	// newline); BodyStart/BodyEnd are its byte offsets in the file.
	Body               string
	BodyStart, BodyEnd int
	// Line is the 1-based line of the figure marker.
	Line int
}

var (
	reFigure  = regexp.MustCompile(`^\s*<!-- figure: ([a-z0-9][a-z0-9.-]*) -->\s*$`)
	reEnd     = regexp.MustCompile(`^\s*<!-- /figure -->\s*$`)
	reCommand = regexp.MustCompile(`^\s*<!-- figure-command: ([a-z0-9][a-z0-9.-]*(?: [a-z0-9][a-z0-9.-]*)*) -->\s*$`)
	reFile    = regexp.MustCompile(`^\s*<!-- figure-file: ((?:[a-z0-9][a-z0-9.-]* )+)([A-Za-z0-9_.-]+) -->\s*$`)
	reAnyMark = regexp.MustCompile(`^\s*<!-- /?figure`)
)

// line is one line of the file with its byte offset.
type line struct {
	text  string // without the newline
	start int
	end   int // after the newline
}

func splitLines(doc []byte) []line {
	var ls []line
	for off := 0; off < len(doc); {
		i := bytes.IndexByte(doc[off:], '\n')
		end := len(doc)
		if i >= 0 {
			end = off + i + 1
		}
		ls = append(ls, line{text: strings.TrimSuffix(string(doc[off:end]), "\n"), start: off, end: end})
		off = end
	}
	return ls
}

// Parse finds every figure in doc. A figure marker without its end, a
// nested or duplicated figure, a command marker not followed by a code
// block, or a figure without a command (or a command without a figure) is
// an error naming the line.
func Parse(doc []byte) ([]Block, error) {
	ls := splitLines(doc)
	var blocks []Block
	commands := map[string]string{}
	files := map[string]map[string]string{}
	seen := map[string]int{}
	for i := 0; i < len(ls); i++ {
		t := ls[i].text
		if m := reCommand.FindStringSubmatch(t); m != nil {
			code, next, err := codeBlock(ls, i+1, indentOf(t))
			if err != nil {
				return nil, fmt.Errorf("line %d: figure-command %s: %w", i+1, m[1], err)
			}
			for _, name := range strings.Fields(m[1]) {
				if _, dup := commands[name]; dup {
					return nil, fmt.Errorf("line %d: second figure-command for %s", i+1, name)
				}
				commands[name] = code
			}
			i = next - 1
			continue
		}
		if m := reFile.FindStringSubmatch(t); m != nil {
			code, next, err := codeBlock(ls, i+1, indentOf(t))
			if err != nil {
				return nil, fmt.Errorf("line %d: figure-file %s%s: %w", i+1, m[1], m[2], err)
			}
			for _, name := range strings.Fields(m[1]) {
				if files[name] == nil {
					files[name] = map[string]string{}
				}
				files[name][m[2]] = code
			}
			i = next - 1
			continue
		}
		if m := reFigure.FindStringSubmatch(t); m != nil {
			if prev, dup := seen[m[1]]; dup {
				return nil, fmt.Errorf("line %d: figure %s already marked at line %d", i+1, m[1], prev)
			}
			seen[m[1]] = i + 1
			j := i + 1
			for ; j < len(ls); j++ {
				if reEnd.MatchString(ls[j].text) {
					break
				}
				if reAnyMark.MatchString(ls[j].text) {
					return nil, fmt.Errorf("line %d: figure %s: marker %q before its <!-- /figure -->", j+1, m[1], ls[j].text)
				}
			}
			if j == len(ls) {
				return nil, fmt.Errorf("line %d: figure %s has no <!-- /figure -->", i+1, m[1])
			}
			b := Block{Name: m[1], Line: i + 1, BodyStart: ls[i].end, BodyEnd: ls[j].start}
			b.Body = string(doc[b.BodyStart:b.BodyEnd])
			blocks = append(blocks, b)
			i = j
			continue
		}
		if reEnd.MatchString(t) {
			return nil, fmt.Errorf("line %d: <!-- /figure --> without a figure", i+1)
		}
		if reAnyMark.MatchString(t) {
			return nil, fmt.Errorf("line %d: malformed figure marker %q", i+1, t)
		}
	}
	for k := range blocks {
		c, ok := commands[blocks[k].Name]
		if !ok {
			return nil, fmt.Errorf("line %d: figure %s has no figure-command", blocks[k].Line, blocks[k].Name)
		}
		blocks[k].Command = c
		blocks[k].Files = files[blocks[k].Name]
		delete(commands, blocks[k].Name)
		delete(files, blocks[k].Name)
	}
	for name := range commands {
		return nil, fmt.Errorf("figure-command %s has no figure", name)
	}
	for name := range files {
		return nil, fmt.Errorf("figure-file for %s has no figure", name)
	}
	return blocks, nil
}

func indentOf(s string) string { return s[:len(s)-len(strings.TrimLeft(s, " "))] }

// codeBlock reads the code block that starts at or after line i (blank
// lines skipped): a fenced block (``` … ```) or an indented one (every line
// indented by four spaces more than the marker, base, or blank; it ends
// before the first line that is neither, and trailing blank lines are not
// part of it). A marker indented inside a list item thus finds the item's
// code block. It returns the code and the index of the first line after it.
func codeBlock(ls []line, i int, base string) (string, int, error) {
	in := base + "    "
	for i < len(ls) && strings.TrimSpace(ls[i].text) == "" {
		i++
	}
	if i == len(ls) {
		return "", i, fmt.Errorf("no code block follows")
	}
	var b strings.Builder
	if fence := strings.TrimSpace(ls[i].text); strings.HasPrefix(fence, "```") {
		indent := indentOf(ls[i].text)
		for j := i + 1; j < len(ls); j++ {
			if strings.TrimSpace(ls[j].text) == "```" {
				return b.String(), j + 1, nil
			}
			b.WriteString(strings.TrimPrefix(ls[j].text, indent))
			b.WriteByte('\n')
		}
		return "", len(ls), fmt.Errorf("code fence at line %d is not closed", i+1)
	}
	if !strings.HasPrefix(ls[i].text, in) {
		return "", i, fmt.Errorf("line %d is not a code block (indented by 4 spaces or fenced)", i+1)
	}
	last := i
	j := i
	for ; j < len(ls); j++ {
		t := ls[j].text
		if strings.TrimSpace(t) == "" {
			continue
		}
		if !strings.HasPrefix(t, in) {
			break
		}
		last = j
	}
	for k := i; k <= last; k++ {
		b.WriteString(strings.TrimPrefix(ls[k].text, in))
		b.WriteByte('\n')
	}
	return b.String(), last + 1, nil
}

// Replace returns doc with the body of the figure name replaced by body
// (which must end in a newline, or be empty). The file is parsed again, so
// the offsets are those of doc as it is now.
func Replace(doc []byte, name, body string) ([]byte, error) {
	if body != "" && !strings.HasSuffix(body, "\n") {
		body += "\n"
	}
	blocks, err := Parse(doc)
	if err != nil {
		return nil, err
	}
	for _, b := range blocks {
		if b.Name == name {
			out := make([]byte, 0, len(doc)-len(b.Body)+len(body))
			out = append(out, doc[:b.BodyStart]...)
			out = append(out, body...)
			out = append(out, doc[b.BodyEnd:]...)
			return out, nil
		}
	}
	return nil, fmt.Errorf("no figure %s in the file", name)
}
