package fsm

import (
	"go/parser"
	"go/token"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestFSMImportsArePure: the state machine replays a log offline, so its
// non-test code may import the standard library (minus the clock, the
// network, the file system and randomness), raft's types and our router.
func TestFSMImportsArePure(t *testing.T) {
	allowed := map[string]bool{"github.com/hashicorp/raft": true, "github.com/kvrouter/kvrouter/router": true}
	banned := []string{"time", "math/rand", "crypto/rand", "os", "net", "syscall", "unsafe", "runtime", "log"}
	files, _ := filepath.Glob("*.go")
	for _, file := range files {
		if strings.HasSuffix(file, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(token.NewFileSet(), file, nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		for _, imp := range f.Imports {
			p, _ := strconv.Unquote(imp.Path.Value)
			first, _, _ := strings.Cut(p, "/")
			if strings.Contains(first, ".") && !allowed[p] {
				t.Errorf("%s imports %s", file, p)
			}
			for _, b := range banned {
				if p == b || strings.HasPrefix(p, b+"/") {
					t.Errorf("%s imports %s: Apply must not see the clock, network, disk or randomness", file, p)
				}
			}
		}
	}
}
