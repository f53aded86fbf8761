package main

import (
	"bufio"
	"io"
	"os"
	"reflect"
	"strings"
	"testing"
)

// TestDynamoNames: every Dynamo flag and environment name in
// testdata/dynamo-names.tsv (with the upstream file it comes from) is
// accepted by `kvrouter serve` and either applies Dynamo's meaning (the
// configuration changes) or logs a startup warning naming it — or is
// marked "same": already what kvrouter does. Rows marked "changes" must
// change it without a warning (implemented), rows marked "warns" must warn
// without changing it (no effect here, and the warning says why).
func TestDynamoNames(t *testing.T) {
	f, err := os.Open("testdata/dynamo-names.tsv")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	base, err := parseServe([]string{"--single-node"}, func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(f)
	rows := 0
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		cols := strings.Split(line, "\t")
		if len(cols) != 5 {
			t.Fatalf("malformed row %q", line)
		}
		kind, name, sample, expect := cols[0], cols[1], cols[2], cols[4]
		rows++
		args := []string{"--single-node"}
		env := map[string]string{}
		switch kind {
		case "flag":
			if sample == "" {
				args = append(args, "--"+name)
			} else {
				args = append(args, "--"+name, sample)
			}
		case "env":
			env[name] = sample
		default:
			t.Fatalf("row %q: kind %q", line, kind)
		}
		var stderr strings.Builder
		got, err := parseServe(args, func(k string) string { return env[k] }, &stderr)
		if err != nil {
			t.Errorf("%s %s=%q refused: %v %s", kind, name, sample, err, stderr.String())
			continue
		}
		warned := len(got.Warnings) > len(base.Warnings)
		got.Warnings = base.Warnings
		changed := !reflect.DeepEqual(got, base)
		switch expect {
		case "same":
			if changed || warned {
				t.Errorf("%s %s=%q is marked same but changed=%v warned=%v", kind, name, sample, changed, warned)
			}
		case "changes-or-warns":
			if !changed && !warned {
				t.Errorf("%s %s=%q accepted but did nothing and said nothing", kind, name, sample)
			}
		case "changes": // implemented with Dynamo's meaning: no "no effect" warning
			if !changed || warned {
				t.Errorf("%s %s=%q is marked implemented but changed=%v warned=%v %s", kind, name, sample, changed, warned, stderr.String())
			}
		case "warns": // accepted without effect: the warning must say so
			if changed || !warned {
				t.Errorf("%s %s=%q is marked no-effect but changed=%v warned=%v", kind, name, sample, changed, warned)
			}
		default:
			t.Fatalf("row %q: expect %q", line, expect)
		}
	}
	if rows < 100 {
		t.Fatalf("only %d names read", rows)
	}
}

// Dynamo's 'None' clears a threshold; --admission-control token-capacity
// fills Dynamo's defaults for the thresholds not given.
func TestDynamoThresholdLiterals(t *testing.T) {
	c, err := parseServe([]string{"--single-node", "--active-decode-blocks-threshold", "0.5", "--active-decode-blocks-threshold", "None"}, func(string) string { return "" }, io.Discard)
	if err != nil || c.Router.Thresholds.ActiveDecodeBlocks != nil {
		t.Fatalf("None: %v %v", err, c.Router.Thresholds.ActiveDecodeBlocks)
	}
	c, err = parseServe([]string{"--single-node", "--admission-control", "token-capacity", "--active-prefill-tokens-threshold", "7"}, func(string) string { return "" }, io.Discard)
	th := c.Router.Thresholds
	if err != nil || th.ActiveDecodeBlocks == nil || *th.ActiveDecodeBlocks != 1 || *th.ActivePrefillTokens != 7 || *th.ActivePrefillTokensFrac != 64 {
		t.Fatalf("token-capacity: %v %+v", err, th)
	}
	if _, err := parseServe([]string{"--single-node", "--admission-control", "maybe"}, func(string) string { return "" }, io.Discard); err == nil {
		t.Fatal("bad admission control accepted")
	}
}
