package main

import (
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/kvrouter/kvrouter/internal/pki"
)

// Secrets kvbench sends, found the way `make run` leaves them, so the
// subcommands that call a local cluster's admin endpoints (ingest
// registers its synthetic workers, load reads the workers' capacity) and
// workers (load --direct) work against it with no flag. Each secret is,
// in this order:
//
//  1. given inline: --admin-token / $KVROUTER_ADMIN_TOKEN,
//     --worker-api-key / $KVROUTER_WORKER_API_KEY (argv is readable by
//     every local user: prefer the files);
//  2. read from a file: --admin-token-file / $KVROUTER_ADMIN_TOKEN_FILE,
//     --worker-api-key-file / $KVROUTER_WORKER_API_KEY_FILE (the
//     variables kvrouter serve reads too);
//  3. make run's file, when it exists, relative to the working directory
//     (run kvbench from the repository root, as for the CA and the replica
//     token): tmp/run/secrets/admin-token, tmp/run/secrets/worker-api-key;
//  4. none.
//
// Giving both 1 and 2 is an error. An explicit file that cannot be read is
// an error; make run's file is only used when it is there.
const (
	defaultRunAdminToken = "tmp/run/secrets/admin-token"
	defaultRunWorkerKey  = "tmp/run/secrets/worker-api-key"
)

// secretOption is one secret's pair of flags.
type secretOption struct {
	name, env, runFile string
	inline, file       string
}

// registerSecret adds --<name> and --<name>-file to fs.
func registerSecret(fs *flag.FlagSet, name, env, runFile, what string) *secretOption {
	s := &secretOption{name: name, env: env, runFile: runFile}
	fs.StringVar(&s.inline, name, os.Getenv(env), what+" (default $"+env+"; prefer --"+name+"-file: argv is visible to every local user)")
	fs.StringVar(&s.file, name+"-file", os.Getenv(env+"_FILE"), "file holding the "+name+" (default $"+env+"_FILE, else make run's "+runFile+" when it exists)")
	return s
}

// resolve returns the secret and where it came from ("" when none).
func (s *secretOption) resolve() (secret, source string, err error) {
	switch {
	case s.inline != "" && s.file != "":
		return "", "", fmt.Errorf("give the %s once: --%s or --%s-file (or their variables $%s, $%s_FILE)", s.name, s.name, s.name, s.env, s.env)
	case s.inline != "":
		return strings.TrimSpace(s.inline), "--" + s.name, nil
	case s.file != "":
		v, err := pki.ReadSecretFile(s.file)
		if err != nil {
			return "", "", fmt.Errorf("--%s-file: %w", s.name, err)
		}
		return v.Reveal(), s.file, nil
	case fileExists(s.runFile):
		v, err := pki.ReadSecretFile(s.runFile)
		if err != nil {
			return "", "", fmt.Errorf("make run's %s: %w", s.runFile, err)
		}
		return v.Reveal(), s.runFile + " (make run's)", nil
	}
	return "", "", nil
}
