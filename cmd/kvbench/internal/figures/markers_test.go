package figures

import (
	"strings"
	"testing"
)

func TestFiguresParse(t *testing.T) {
	cases := []struct {
		name    string
		doc     string
		want    []Block // Name, Command, Body, Files compared
		wantErr string
	}{
		{
			name: "indented command, one figure",
			doc:  "# T\n\n<!-- figure-command: a -->\n\n    kvbench sim --json a.json \\\n      --seed 1\n\n    # a comment\n\nText.\n\n<!-- figure: a -->\n| x |\n|---|\n<!-- /figure -->\nafter\n",
			want: []Block{{Name: "a", Command: "kvbench sim --json a.json \\\n  --seed 1\n\n# a comment\n", Body: "| x |\n|---|\n"}},
		},
		{
			name: "fenced command and a file",
			doc:  "<!-- figure-command: b -->\n```sh\nkvbench sim\n```\n<!-- figure-file: b z gen.py -->\n```python\nprint(1)\n```\n<!-- figure: b -->\nold\n<!-- /figure -->\n<!-- figure-command: z -->\n    y\n<!-- figure: z -->\n<!-- /figure -->\n",
			want: []Block{{Name: "b", Command: "kvbench sim\n", Body: "old\n", Files: map[string]string{"gen.py": "print(1)\n"}},
				{Name: "z", Command: "y\n", Files: map[string]string{"gen.py": "print(1)\n"}}},
		},
		{
			name: "one command, two figures, empty body",
			doc:  "<!-- figure-command: c d -->\n\n    kvbench disagg\n\n<!-- figure: d -->\n<!-- /figure -->\n<!-- figure: c -->\nc\n<!-- /figure -->\n",
			want: []Block{{Name: "d", Command: "kvbench disagg\n", Body: ""}, {Name: "c", Command: "kvbench disagg\n", Body: "c\n"}},
		},
		{
			name: "inside a list item",
			doc:  "- item:\n\n  <!-- figure-command: e -->\n\n      kvbench sim \\\n        --seed 1\n\n  <!-- figure: e -->\n  | x |\n  <!-- /figure -->\n",
			want: []Block{{Name: "e", Command: "kvbench sim \\\n  --seed 1\n", Body: "  | x |\n"}},
		},
		{
			name: "no markers",
			doc:  "# nothing\n\n    kvbench sim\n",
		},
		{name: "unclosed figure", doc: "<!-- figure-command: a -->\n    x\n<!-- figure: a -->\n| x |\n", wantErr: "has no <!-- /figure -->"},
		{name: "nested figure", doc: "<!-- figure-command: a b -->\n    x\n<!-- figure: a -->\n<!-- figure: b -->\n<!-- /figure -->\n", wantErr: "before its <!-- /figure -->"},
		{name: "stray end", doc: "text\n<!-- /figure -->\n", wantErr: "without a figure"},
		{name: "duplicate figure", doc: "<!-- figure-command: a -->\n    x\n<!-- figure: a -->\n<!-- /figure -->\n<!-- figure: a -->\n<!-- /figure -->\n", wantErr: "already marked"},
		{name: "figure without command", doc: "<!-- figure: a -->\n<!-- /figure -->\n", wantErr: "has no figure-command"},
		{name: "command without figure", doc: "<!-- figure-command: a -->\n    x\n", wantErr: "has no figure"},
		{name: "command not followed by code", doc: "<!-- figure-command: a -->\n\nprose\n<!-- figure: a -->\n<!-- /figure -->\n", wantErr: "not a code block"},
		{name: "unclosed fence", doc: "<!-- figure-command: a -->\n```\nx\n", wantErr: "not closed"},
		{name: "malformed marker", doc: "<!-- figure: Bad Name -->\n", wantErr: "malformed"},
		{name: "two commands for one figure", doc: "<!-- figure-command: a -->\n    x\n<!-- figure-command: a -->\n    y\n", wantErr: "second figure-command"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := Parse([]byte(c.doc))
			if c.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), c.wantErr) {
					t.Fatalf("err = %v, want one containing %q", err, c.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != len(c.want) {
				t.Fatalf("got %d blocks, want %d: %+v", len(got), len(c.want), got)
			}
			for i, w := range c.want {
				g := got[i]
				if g.Name != w.Name || g.Command != w.Command || g.Body != w.Body {
					t.Errorf("block %d = {%q %q %q}, want {%q %q %q}", i, g.Name, g.Command, g.Body, w.Name, w.Command, w.Body)
				}
				if c.doc[g.BodyStart:g.BodyEnd] != g.Body {
					t.Errorf("block %d: offsets %d:%d do not hold its body", i, g.BodyStart, g.BodyEnd)
				}
				if len(g.Files) != len(w.Files) {
					t.Errorf("block %d: files %v, want %v", i, g.Files, w.Files)
				}
				for p, text := range w.Files {
					if g.Files[p] != text {
						t.Errorf("block %d: file %s = %q, want %q", i, p, g.Files[p], text)
					}
				}
			}
		})
	}
}

func TestFiguresReplace(t *testing.T) {
	doc := "head\n<!-- figure-command: a b -->\n\n    cmd\n\n<!-- figure: a -->\n| old a |\n<!-- /figure -->\nmiddle\n<!-- figure: b -->\n<!-- /figure -->\ntail"
	cases := []struct {
		name, fig, body, want, wantErr string
	}{
		{name: "replace a", fig: "a", body: "| new a |\n| row |\n",
			want: "head\n<!-- figure-command: a b -->\n\n    cmd\n\n<!-- figure: a -->\n| new a |\n| row |\n<!-- /figure -->\nmiddle\n<!-- figure: b -->\n<!-- /figure -->\ntail"},
		{name: "fill an empty body, newline added", fig: "b", body: "x",
			want: "head\n<!-- figure-command: a b -->\n\n    cmd\n\n<!-- figure: a -->\n| old a |\n<!-- /figure -->\nmiddle\n<!-- figure: b -->\nx\n<!-- /figure -->\ntail"},
		{name: "empty a", fig: "a", body: "",
			want: "head\n<!-- figure-command: a b -->\n\n    cmd\n\n<!-- figure: a -->\n<!-- /figure -->\nmiddle\n<!-- figure: b -->\n<!-- /figure -->\ntail"},
		{name: "unknown", fig: "c", body: "x", wantErr: "no figure c"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := Replace([]byte(doc), c.fig, c.body)
			if c.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), c.wantErr) {
					t.Fatalf("err = %v, want %q", err, c.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != c.want {
				t.Errorf("got\n%s\nwant\n%s", got, c.want)
			}
			// Replacing with the old body gives the document back.
			blocks, err := Parse(got)
			if err != nil {
				t.Fatal(err)
			}
			for _, b := range blocks {
				if b.Name == c.fig {
					orig, _ := Parse([]byte(doc))
					for _, o := range orig {
						if o.Name == c.fig {
							back, err := Replace(got, c.fig, o.Body)
							if err != nil || string(back) != doc {
								t.Errorf("round trip: %v\n%s", err, back)
							}
						}
					}
				}
			}
		})
	}
}

func TestFiguresDiff(t *testing.T) {
	cases := []struct{ a, b, want string }{
		{"x\ny\nz\n", "x\ny\nz\n", ""},
		{"a\nb\nc\n", "a\nB\nc\n", "  a\n- b\n+ B\n  c\n"},
		{"1\n2\n3\n4\n5\n6\n7\n8\n", "1\n2\n3\n4\n5\n6\n7\nX\n", "  6\n  7\n- 8\n+ X\n"},
		{"1\n2\n3\n4\n5\n6\n7\n8\n", "0\n1\n2\n3\n4\n5\n6\n7\n", "+ 0\n  1\n  2\n  …\n  6\n  7\n- 8\n"},
	}
	for _, c := range cases {
		if got := Diff(c.a, c.b); got != c.want {
			t.Errorf("Diff(%q, %q) =\n%s\nwant\n%s", c.a, c.b, got, c.want)
		}
	}
}

func TestFiguresRegistryNamesUnique(t *testing.T) {
	seen := map[string]bool{}
	for _, f := range Registry() {
		if seen[f.Name] || !reFigure.MatchString("<!-- figure: "+f.Name+" -->") || f.Format == nil {
			t.Errorf("bad or duplicate registry entry %q", f.Name)
		}
		seen[f.Name] = true
	}
}
