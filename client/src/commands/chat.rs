//! `spillway chat`: an interactive conversation. Each line read from stdin is a user turn; the
//! whole history goes to the daemon as chat messages (the model's chat template renders it) and
//! the reply streams back and joins the history. `/reset` forgets it; `/exit` or end of input
//! quits.

use std::io::{BufRead, IsTerminal, Write};

use clap::Args;
use spillway_proto::v1 as pb;

use super::generate::SamplingArgs;
use crate::connect::Client;
use crate::exit::Failure;

#[derive(Debug, Clone, Args)]
pub struct ChatArgs {
    /// A system message that opens the conversation.
    #[arg(long)]
    pub system: Option<String>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

pub async fn run(client: &mut Client, args: &ChatArgs) -> Result<(), Failure> {
    let interactive = std::io::stdin().is_terminal();
    let mut history = Vec::new();
    let opening = || {
        args.system
            .iter()
            .map(|s| message("system", s))
            .collect::<Vec<_>>()
    };
    history.extend(opening());
    if interactive {
        eprintln!("Chatting with the daemon's model; /reset forgets, /exit or Ctrl-D quits.");
    }
    let mut lines = std::io::stdin().lock().lines();
    loop {
        if interactive {
            eprint!("> ");
            let _ = std::io::stderr().flush();
        }
        let Some(line) = lines.next() else { break };
        let line = line?;
        let turn = line.trim();
        match turn {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                history = opening();
                continue;
            }
            _ => {}
        }
        history.push(message("user", turn));
        let req = args
            .sampling
            .request(pb::generate_request::Input::Chat(pb::ChatMessages {
                messages: history.clone(),
            }));
        let mut stream = client
            .generate(args.sampling.wrap(req)?)
            .await?
            .into_inner();
        let mut reply = String::new();
        let mut out = std::io::stdout().lock();
        while let Some(msg) = stream.message().await? {
            let _ = out
                .write_all(msg.text.as_bytes())
                .and_then(|()| out.flush());
            reply.push_str(&msg.text);
        }
        let _ = writeln!(out);
        history.push(message("assistant", &reply));
    }
    Ok(())
}

fn message(role: &str, content: &str) -> pb::ChatMessage {
    pb::ChatMessage {
        role: role.into(),
        content: content.into(),
    }
}
